//! Client identities and per-export authorization, end to end (issue 18 item 4): a
//! throwaway CA (server and client certificates) and token issuers (an ES256 and an RS256
//! key set) made here, a server configured with exports, and clients with tokens,
//! certificates or the secret. Every refusal is checked for its message, its exit code
//! (3) and for having touched nothing on disk: no file, no directory, no partial file, no
//! journal.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use common::{node, snapshot, state_dir, wanxfer_bin, Node, Run, SECRET};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, SanType,
};

const ISSUER: &str = "https://tokens.example.org";
const RSA_ISSUER: &str = "https://rsa-tokens.example.org";
const AUDIENCE: &str = "https://dtn.example.org";

/// Certificates, key sets and a served tree, in one temporary directory.
struct Pki {
    dir: tempfile::TempDir,
    es_key: jsonwebtoken::EncodingKey,
    rsa_key: jsonwebtoken::EncodingKey,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let at = |name: &str| dir.path().join(name);
        // The CA that vouches for the server and the clients.
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "wanxfer test CA");
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        fs::write(at("ca.pem"), ca.pem()).unwrap();
        let leaf = |name: &str, dn: &str, server: bool| {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.distinguished_name.push(DnType::CommonName, dn);
            if server {
                params.subject_alt_names = vec![SanType::IpAddress("127.0.0.1".parse().unwrap())];
                params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
            } else {
                params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
            }
            let key = KeyPair::generate().unwrap();
            let cert = params.signed_by(&key, &ca).unwrap();
            fs::write(at(&format!("{name}.pem")), cert.pem()).unwrap();
            fs::write(at(&format!("{name}.key")), key.serialize_pem()).unwrap();
        };
        leaf("server", "127.0.0.1", true);
        leaf("alice", "alice", false);
        leaf("bob", "bob", false);
        // A certificate from a CA the server does not know.
        let mut other_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        other_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let other =
            CertifiedIssuer::self_signed(other_params, KeyPair::generate().unwrap()).unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, "alice");
        let key = KeyPair::generate().unwrap();
        fs::write(
            at("stranger.pem"),
            params.signed_by(&key, &other).unwrap().pem(),
        )
        .unwrap();
        fs::write(at("stranger.key"), key.serialize_pem()).unwrap();

        // ES256 issuer: a P-256 key and its JWKS.
        let es = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let point = es.public_key_raw();
        assert_eq!(point.len(), 65, "an uncompressed P-256 point");
        let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
        let jwks = serde_json::json!({"keys": [{
            "kty": "EC", "crv": "P-256", "alg": "ES256", "use": "sig", "kid": "es1",
            "x": b64(&point[1..33]), "y": b64(&point[33..]),
        }]});
        fs::write(at("es.jwks"), jwks.to_string()).unwrap();
        let es_key = jsonwebtoken::EncodingKey::from_ec_der(&es.serialize_der());

        // RS256 issuer: an RSA key from openssl (Debian's base system has it).
        let rsa_pem = at("rsa.pem");
        let made = Command::new("openssl")
            .args([
                "genpkey",
                "-algorithm",
                "RSA",
                "-pkeyopt",
                "rsa_keygen_bits:2048",
                "-out",
            ])
            .arg(&rsa_pem)
            .output()
            .expect("openssl is installed");
        assert!(made.status.success(), "{made:?}");
        let modulus = Command::new("openssl")
            .args(["rsa", "-noout", "-modulus", "-in"])
            .arg(&rsa_pem)
            .output()
            .unwrap();
        let hex = String::from_utf8(modulus.stdout).unwrap();
        let hex = hex.trim().strip_prefix("Modulus=").unwrap();
        let n: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let jwks = serde_json::json!({"keys": [{
            "kty": "RSA", "alg": "RS256", "kid": "rsa1", "n": b64(&n), "e": "AQAB",
        }]});
        fs::write(at("rsa.jwks"), jwks.to_string()).unwrap();
        let rsa_der = at("rsa.der");
        let converted = Command::new("openssl")
            .args(["rsa", "-traditional", "-outform", "DER", "-in"])
            .arg(&rsa_pem)
            .arg("-out")
            .arg(&rsa_der)
            .output()
            .unwrap();
        assert!(converted.status.success(), "{converted:?}");
        let rsa_key = jsonwebtoken::EncodingKey::from_rsa_der(&fs::read(&rsa_der).unwrap());

        for export in ["data", "pub", "certs", "team"] {
            fs::create_dir_all(at(export)).unwrap();
        }
        Pki {
            dir,
            es_key,
            rsa_key,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A token signed by the ES256 issuer, with these claims over the defaults.
    fn token(&self, overrides: serde_json::Value) -> PathBuf {
        self.sign(
            jsonwebtoken::Algorithm::ES256,
            "es1",
            &self.es_key,
            ISSUER,
            overrides,
        )
    }

    fn sign(
        &self,
        alg: jsonwebtoken::Algorithm,
        kid: &str,
        key: &jsonwebtoken::EncodingKey,
        issuer: &str,
        overrides: serde_json::Value,
    ) -> PathBuf {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let mut claims = serde_json::json!({
            "iss": issuer, "sub": "alice", "aud": AUDIENCE, "wlcg.ver": "1.0",
            "iat": now, "nbf": now, "exp": now + 600,
            "scope": "storage.read:/ storage.create:/ storage.modify:/",
        });
        for (k, v) in overrides.as_object().unwrap() {
            claims[k] = v.clone();
        }
        let mut header = jsonwebtoken::Header::new(alg);
        header.kid = Some(kid.into());
        let token = jsonwebtoken::encode(&header, &claims, key).unwrap();
        let file = self.path(&format!("token-{}", rand_name()));
        fs::write(&file, token).unwrap();
        file
    }

    /// The server's configuration: three exports and both issuers.
    fn config(&self) -> PathBuf {
        let text = format!(
            r#"
listen = "127.0.0.1:0"
cert = "{server_pem}"
key = "{server_key}"
client-ca = "{ca}"
audience = ["{AUDIENCE}"]

[[issuer]]
issuer = "{ISSUER}"
jwks = "{es}"

[[issuer]]
issuer = "{RSA_ISSUER}"
jwks = "{rsa}"

[[export]]
name = "data"
path = "{data}"
read = ["token:{ISSUER}", "token:{RSA_ISSUER}"]
write = ["token:{ISSUER}"]

[[export]]
name = "pub"
path = "{public}"
read = ["secret", "token:{ISSUER}"]

[[export]]
name = "certs"
path = "{certs}"
read = ["dn:*"]
write = ["dn:CN=alice"]

[[export]]
name = "team"
path = "{team}"
write = ["token:{ISSUER}#carol"]
"#,
            server_pem = self.path("server.pem").display(),
            server_key = self.path("server.key").display(),
            ca = self.path("ca.pem").display(),
            es = self.path("es.jwks").display(),
            rsa = self.path("rsa.jwks").display(),
            data = self.path("data").display(),
            public = self.path("pub").display(),
            certs = self.path("certs").display(),
            team = self.path("team").display(),
        );
        let file = self.path("wanxfer.toml");
        fs::write(&file, text).unwrap();
        file
    }

    /// [`Pki::config`] without the one export that lists `secret`.
    fn config_without_secret(&self) -> PathBuf {
        let text = fs::read_to_string(self.config()).unwrap();
        let (before, pub_export) = text.split_once("[[export]]\nname = \"pub\"").unwrap();
        let (_, after) = pub_export.split_once("\n\n").unwrap();
        assert!(!after.contains("\"secret\""), "{after}");
        let file = self.path("wanxfer-no-secret.toml");
        fs::write(&file, format!("{before}{after}")).unwrap();
        file
    }
}

fn rand_name() -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    N.fetch_add(1, Ordering::Relaxed).to_string()
}

/// `wanxfer serve --config FILE`, killed on drop.
struct Served {
    child: Child,
    addr: String,
    log: PathBuf,
    state: PathBuf,
}

impl Served {
    fn start(pki: &Pki) -> Served {
        Served::start_with(pki, &pki.config(), Some(SECRET))
    }

    fn start_with(pki: &Pki, config: &Path, secret: Option<&str>) -> Served {
        let log = pki.path(&format!("serve-{}.log", rand_name()));
        let state = pki.path(&format!("server-state-{}", rand_name()));
        let mut cmd = Command::new(wanxfer_bin());
        match secret {
            Some(secret) => cmd.env("WANXFER_SECRET", secret),
            None => cmd.env_remove("WANXFER_SECRET"),
        };
        let mut child = cmd
            .args(["serve", "--config"])
            .arg(config)
            .arg("--state-dir")
            .arg(&state)
            .env("WANXFER_STATE_DIR", state_dir())
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .expect("start wanxfer serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .rsplit(" on ")
            .next()
            .filter(|a| a.parse::<std::net::SocketAddr>().is_ok())
            .unwrap_or_else(|| {
                panic!(
                    "server did not start: {line:?}\n{}",
                    fs::read_to_string(&log).unwrap_or_default()
                )
            })
            .to_string();
        Served {
            child,
            addr,
            log,
            state,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("wanxfer://{}/{path}", self.addr)
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Journals of interrupted transfers the server keeps.
    fn journals(&self) -> Vec<PathBuf> {
        let mut found = Vec::new();
        let mut stack = vec![self.state.clone()];
        while let Some(dir) = stack.pop() {
            for e in fs::read_dir(&dir).into_iter().flatten().flatten() {
                if e.file_type().unwrap().is_dir() {
                    stack.push(e.path());
                } else if e.file_name().to_string_lossy().contains("journal") {
                    found.push(e.path());
                }
            }
        }
        found
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `wanxfer SUBCOMMAND` with no secret in the environment (WLCG discovery variables
/// cleared too), verifying the server against the test CA.
fn run(pki: &Pki, subcommand: &str, args: &[&std::ffi::OsStr]) -> Run {
    let mut cmd = Command::new(wanxfer_bin());
    cmd.arg(subcommand);
    if subcommand == "cp" {
        cmd.arg("--quiet");
    }
    cmd.arg("--ca")
        .arg(pki.path("ca.pem"))
        .args(args)
        .env_remove("WANXFER_SECRET")
        .env_remove("BEARER_TOKEN")
        .env_remove("BEARER_TOKEN_FILE")
        .env_remove("XDG_RUNTIME_DIR")
        .env("WANXFER_STATE_DIR", state_dir())
        .env_remove("RUST_LOG");
    Run::from_cmd(cmd)
}

/// `wanxfer SUBCOMMAND` proving the shared secret, verifying the server against the
/// test CA.
fn with_secret(pki: &Pki, subcommand: &str, args: &[&str]) -> Run {
    let mut cmd = Command::new(wanxfer_bin());
    cmd.arg(subcommand)
        .args(if subcommand == "cp" {
            vec!["--quiet"]
        } else {
            vec![]
        })
        .arg("--ca")
        .arg(pki.path("ca.pem"))
        .args(args)
        .env("WANXFER_SECRET", SECRET)
        .env("WANXFER_STATE_DIR", state_dir());
    Run::from_cmd(cmd)
}

fn os(s: &str) -> &std::ffi::OsStr {
    std::ffi::OsStr::new(s)
}

fn with_token<'a>(token: &'a Path, rest: &[&'a std::ffi::OsStr]) -> Vec<&'a std::ffi::OsStr> {
    let mut args = vec![os("--token"), token.as_os_str()];
    args.extend_from_slice(rest);
    args
}

/// What an export holds, hidden files (partial files) included.
fn tree(path: &Path) -> BTreeMap<Vec<u8>, Node> {
    snapshot(path)
}

#[test]
fn a_valid_token_pushes_and_pulls_within_its_export() {
    let pki = Pki::new();
    let server = Served::start(&pki);
    let src = pki.path("src.bin");
    common::write_pattern(&src, 3 << 20, 7);
    let token = pki.token(serde_json::json!({}));
    let url = server.url("data/in/run1.bin");
    run(
        &pki,
        "mkdir",
        &with_token(&token, &[os(&server.url("data/in"))]),
    )
    .assert_ok();
    run(
        &pki,
        "cp",
        &with_token(&token, &[src.as_os_str(), os(&url)]),
    )
    .assert_ok();
    assert_eq!(
        fs::read(pki.path("data/in/run1.bin")).unwrap(),
        fs::read(&src).unwrap()
    );
    let back = pki.path("back.bin");
    run(
        &pki,
        "cp",
        &with_token(&token, &[os(&url), back.as_os_str()]),
    )
    .assert_ok();
    assert_eq!(fs::read(&back).unwrap(), fs::read(&src).unwrap());
    // The RS256 issuer may read this export (not write it).
    let rsa = pki.sign(
        jsonwebtoken::Algorithm::RS256,
        "rsa1",
        &pki.rsa_key,
        RSA_ISSUER,
        serde_json::json!({"scope": "storage.read:/in"}),
    );
    let again = pki.path("again.bin");
    run(
        &pki,
        "cp",
        &with_token(&rsa, &[os(&url), again.as_os_str()]),
    )
    .assert_ok();
    assert_eq!(fs::read(&again).unwrap(), fs::read(&src).unwrap());
    let log = server.log();
    assert!(
        log.contains("token sub=alice iss=https://tokens.example.org"),
        "{log}"
    );
}

#[test]
fn bad_tokens_are_refused_and_touch_nothing() {
    let pki = Pki::new();
    let server = Served::start(&pki);
    let src = pki.path("src.bin");
    common::write_pattern(&src, 1 << 20, 3);
    fs::create_dir(pki.path("data/in")).unwrap();
    fs::create_dir(pki.path("data/other")).unwrap();
    let before = tree(&pki.path("data"));
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let mut tampered = fs::read_to_string(pki.token(serde_json::json!({}))).unwrap();
    // One signature character changed: the claims are intact, the signature not. Not the
    // last one, whose low bits are padding (changing them can make invalid base64, a
    // different refusal), but one in the middle, which carries six bits of signature.
    let token = tampered.trim_end().to_string();
    let at = token.rfind('.').unwrap() + (token.len() - token.rfind('.').unwrap()) / 2;
    let flipped = if token.as_bytes()[at] == b'A' {
        "B"
    } else {
        "A"
    };
    tampered = format!("{}{flipped}{}", &token[..at], &token[at + 1..]);
    let tampered_file = pki.path("tampered");
    fs::write(&tampered_file, tampered).unwrap();
    let unknown = pki.token(serde_json::json!({"iss": "https://elsewhere.example"}));
    let cases: Vec<(&str, PathBuf, &str)> = vec![
        (
            "expired",
            pki.token(serde_json::json!({"exp": now - 3600, "nbf": now - 7200})),
            "expired",
        ),
        (
            "another audience",
            pki.token(serde_json::json!({"aud": "https://other.example"})),
            "audience is not this server's",
        ),
        ("tampered", tampered_file, "signature does not verify"),
        ("unknown issuer", unknown, "is not one this server trusts"),
        (
            "no create scope",
            pki.token(serde_json::json!({"scope": "storage.read:/"})),
            "no scope storage.create:/in/new.bin",
        ),
        (
            "scope for another path",
            pki.token(serde_json::json!({"scope": "storage.create:/other storage.modify:/other"})),
            "no scope storage.create:/in/new.bin",
        ),
    ];
    for (what, token, message) in &cases {
        let url = server.url("data/in/new.bin");
        let r = run(&pki, "cp", &with_token(token, &[src.as_os_str(), os(&url)]));
        r.assert_code(3);
        assert!(r.stderr.contains(message), "{what}: {}", r.stderr);
        assert!(
            !r.stderr.contains(&pki.path("data").display().to_string()),
            "{what}: {}",
            r.stderr
        );
        assert_eq!(
            tree(&pki.path("data")),
            before,
            "{what}: something was touched"
        );
    }
    // Remote operations are refused the same way.
    let read_only = pki.token(serde_json::json!({"scope": "storage.read:/"}));
    run(
        &pki,
        "mkdir",
        &with_token(&read_only, &[os(&server.url("data/in/d"))]),
    )
    .assert_code(3);
    let expired = &cases[0].1;
    run(
        &pki,
        "ls",
        &with_token(expired, &[os(&server.url("data/in"))]),
    )
    .assert_code(3);
    assert_eq!(tree(&pki.path("data")), before);
    assert!(server.journals().is_empty(), "{:?}", server.journals());
    // Never on a connection without encryption.
    let good = pki.token(serde_json::json!({}));
    let plain_url = server.url("data/in/x");
    let mut args = with_token(&good, &[src.as_os_str(), os(&plain_url)]);
    args.push(os("--no-encryption"));
    let mut cmd = Command::new(wanxfer_bin());
    cmd.args(["cp", "--quiet"])
        .args(&args)
        .env_remove("WANXFER_SECRET")
        .env("WANXFER_STATE_DIR", state_dir());
    Run::from_cmd(cmd).assert_code(2);
    assert_eq!(tree(&pki.path("data")), before);
    // Never to a server whose certificate is neither verified (--ca) nor pinned: without
    // the secret, nothing else says it is the server meant.
    let mut cmd = Command::new(wanxfer_bin());
    cmd.args(["cp", "--quiet", "--token"])
        .arg(&good)
        .arg(&src)
        .arg(server.url("data/in/y"))
        .env_remove("WANXFER_SECRET")
        .env("WANXFER_STATE_DIR", pki.path("fresh-client-state"));
    let r = Run::from_cmd(cmd);
    r.assert_code(3);
    assert!(r.stderr.contains("not pinned yet"), "{}", r.stderr);
    assert_eq!(tree(&pki.path("data")), before);
}

/// `token:ISSUER#SUBJECT` admits that subject's tokens without storage scopes (identity
/// based), other subjects not at all, and a scope the token does carry still binds.
#[test]
fn a_token_subject_named_by_an_export_writes_without_scopes() {
    let pki = Pki::new();
    let server = Served::start(&pki);
    let src = pki.path("src.bin");
    common::write_pattern(&src, 1 << 20, 4);
    let push = |claims: serde_json::Value, name: &str| {
        let token = pki.token(claims);
        let url = server.url(&format!("team/{name}"));
        run(
            &pki,
            "cp",
            &with_token(&token, &[src.as_os_str(), os(&url)]),
        )
    };
    push(
        serde_json::json!({"sub": "carol", "scope": ""}),
        "by-carol.bin",
    )
    .assert_ok();
    assert_eq!(
        fs::read(pki.path("team/by-carol.bin")).unwrap(),
        fs::read(&src).unwrap()
    );
    let before = tree(&pki.path("team"));
    push(serde_json::json!({}), "by-alice.bin")
        .assert_code(3)
        .assert_stderr_mentions("sub=alice");
    push(
        serde_json::json!({"sub": "carol", "scope": "storage.create:/elsewhere"}),
        "scoped.bin",
    )
    .assert_code(3)
    .assert_stderr_mentions("storage.create:/scoped.bin");
    assert_eq!(tree(&pki.path("team")), before);
}

/// A copy between two servers with a token for each side: the source reads with one,
/// the destination grants with the other, and a token without create scope there stops
/// it before anything moves.
#[test]
fn a_copy_between_two_servers_takes_a_token_for_each_side() {
    let pki = Pki::new();
    let a = Served::start(&pki);
    let b = Served::start(&pki);
    common::write_pattern(&pki.path("data/tpc-src.bin"), 2 << 20, 6);
    let reader = pki.token(serde_json::json!({"scope": "storage.read:/"}));
    let writer = pki.token(serde_json::json!({"scope": "storage.create:/"}));
    let copy = |dest_token: &Path, name: &str| {
        run(
            &pki,
            "cp",
            &[
                os("--source-token"),
                reader.as_os_str(),
                os("--dest-token"),
                dest_token.as_os_str(),
                os(&a.url("data/tpc-src.bin")),
                os(&b.url(&format!("data/{name}"))),
            ],
        )
    };
    copy(&writer, "tpc-copy.bin").assert_ok();
    assert_eq!(
        fs::read(pki.path("data/tpc-copy.bin")).unwrap(),
        fs::read(pki.path("data/tpc-src.bin")).unwrap()
    );
    let before = tree(&pki.path("data"));
    copy(&reader, "tpc-refused.bin")
        .assert_code(3)
        .assert_stderr_mentions("storage.create");
    assert_eq!(tree(&pki.path("data")), before);
}

/// A server whose exports name only tokens and certificates starts without a secret. A
/// token works; a client proving a secret is told the server takes none, exit 3.
#[test]
fn a_server_without_a_secret_takes_only_credentials() {
    let pki = Pki::new();
    let server = Served::start_with(&pki, &pki.config_without_secret(), None);
    let src = pki.path("src.bin");
    common::write_pattern(&src, 1 << 20, 9);
    let token = pki.token(serde_json::json!({}));
    let url = server.url("data/no-secret.bin");
    run(
        &pki,
        "cp",
        &with_token(&token, &[src.as_os_str(), os(&url)]),
    )
    .assert_ok();
    assert_eq!(
        fs::read(pki.path("data/no-secret.bin")).unwrap(),
        fs::read(&src).unwrap()
    );
    let before = tree(&pki.path("data"));
    let (src_s, dest) = (src.to_str().unwrap(), server.url("data/by-secret.bin"));
    with_secret(&pki, "cp", &[src_s, &dest])
        .assert_code(3)
        .assert_stderr_mentions("takes no shared secret");
    assert_eq!(tree(&pki.path("data")), before);
}

#[test]
fn a_read_only_identity_changes_nothing() {
    let pki = Pki::new();
    let server = Served::start(&pki);
    fs::create_dir(pki.path("pub/dir")).unwrap();
    fs::write(pki.path("pub/dir/a.txt"), b"hello").unwrap();
    let before = tree(&pki.path("pub"));
    let src = pki.path("src.bin");
    common::write_pattern(&src, 1 << 20, 5);
    let secret = |sub: &str, args: &[&str]| with_secret(&pki, sub, args);
    let src_s = src.to_str().unwrap();
    for (what, r) in [
        (
            "push new",
            secret("cp", &[src_s, &server.url("pub/new.bin")]),
        ),
        (
            "push over",
            secret("cp", &[src_s, &server.url("pub/dir/a.txt")]),
        ),
        ("push into", secret("cp", &[src_s, &server.url("pub/dir/")])),
        ("mkdir", secret("mkdir", &[&server.url("pub/newdir")])),
        ("rm", secret("rm", &[&server.url("pub/dir/a.txt")])),
        ("rm -r", secret("rm", &["-r", &server.url("pub/dir")])),
        (
            "mv",
            secret(
                "mv",
                &[&server.url("pub/dir/a.txt"), &server.url("pub/b.txt")],
            ),
        ),
    ] {
        r.assert_code(3);
        assert!(r.stderr.contains("may not write"), "{what}: {}", r.stderr);
        assert_eq!(
            tree(&pki.path("pub")),
            before,
            "{what}: something was touched"
        );
    }
    // Reading is allowed: the file comes back, and a listing works.
    let got = pki.path("got.txt");
    secret("cp", &[&server.url("pub/dir/a.txt"), got.to_str().unwrap()]).assert_ok();
    assert_eq!(fs::read(&got).unwrap(), b"hello");
    secret("ls", &[&server.url("pub/dir")]).assert_ok();
    // The secret is not admitted to an export that does not list it.
    secret("ls", &[&server.url("data")]).assert_code(3);
    assert!(server.journals().is_empty());
}

#[test]
fn client_certificates_are_known_by_their_subject() {
    let pki = Pki::new();
    let server = Served::start(&pki);
    let src = pki.path("src.bin");
    common::write_pattern(&src, 2 << 20, 9);
    let as_cert = |name: &str, rest: &[&std::ffi::OsStr]| {
        let cert = pki.path(&format!("{name}.pem"));
        let key = pki.path(&format!("{name}.key"));
        let mut args = vec![os("--cert"), cert.as_os_str(), os("--key"), key.as_os_str()];
        args.extend_from_slice(rest);
        let owned: Vec<std::ffi::OsString> = args.iter().map(|a| a.to_os_string()).collect();
        owned
    };
    let call = |sub: &str, args: Vec<std::ffi::OsString>| {
        let refs: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        run(&pki, sub, &refs)
    };
    let url = server.url("certs/run.bin");
    call("cp", as_cert("alice", &[src.as_os_str(), os(&url)])).assert_ok();
    assert_eq!(
        fs::read(pki.path("certs/run.bin")).unwrap(),
        fs::read(&src).unwrap()
    );
    let before = tree(&pki.path("certs"));
    // bob may read (dn:*), not write.
    let r = call(
        "cp",
        as_cert("bob", &[src.as_os_str(), os(&server.url("certs/bob.bin"))]),
    );
    r.assert_code(3);
    assert!(
        r.stderr.contains("certificate CN=bob may not write"),
        "{}",
        r.stderr
    );
    let back = pki.path("bob-read.bin");
    call("cp", as_cert("bob", &[os(&url), back.as_os_str()])).assert_ok();
    // A certificate from a CA the server does not trust fails the TLS handshake.
    let r = call("ls", as_cert("stranger", &[os(&server.url("certs"))]));
    assert_ne!(r.code, 0, "{r:?}");
    // No certificate: the secret is not on this export's lists.
    let mut cmd = Command::new(wanxfer_bin());
    cmd.args(["ls", "--ca"])
        .arg(pki.path("ca.pem"))
        .arg(server.url("certs"))
        .env("WANXFER_SECRET", SECRET)
        .env("WANXFER_STATE_DIR", state_dir());
    let r = Run::from_cmd(cmd);
    r.assert_code(3);
    assert!(
        r.stderr.contains("shared secret may not read"),
        "{}",
        r.stderr
    );
    assert_eq!(tree(&pki.path("certs")), before);
    assert!(
        server.log().contains("certificate CN=alice"),
        "{}",
        server.log()
    );
}

#[test]
fn exports_confine_paths() {
    let pki = Pki::new();
    let server = Served::start(&pki);
    let outside = pki.path("outside");
    fs::create_dir(&outside).unwrap();
    fs::write(outside.join("secret.txt"), b"not yours").unwrap();
    std::os::unix::fs::symlink(&outside, pki.path("data/link")).unwrap();
    let token = pki.token(serde_json::json!({}));
    let got = pki.path("got");
    // Through a symlink out of the export.
    let r = run(
        &pki,
        "cp",
        &with_token(
            &token,
            &[os(&server.url("data/link/secret.txt")), got.as_os_str()],
        ),
    );
    r.assert_code(8);
    assert!(!got.exists());
    assert!(
        !r.stderr.contains(&pki.path("data").display().to_string()),
        "{}",
        r.stderr
    );
    // A push through the symlink, and one with .. (refused before it leaves the client).
    let src = pki.path("src.bin");
    common::write_pattern(&src, 4096, 1);
    run(
        &pki,
        "cp",
        &with_token(&token, &[src.as_os_str(), os(&server.url("data/link/x"))]),
    )
    .assert_code(8);
    let r = run(
        &pki,
        "cp",
        &with_token(&token, &[src.as_os_str(), os(&server.url("data/../pub/x"))]),
    );
    assert_ne!(r.code, 0);
    assert_eq!(
        node(&outside.join("secret.txt")),
        node(&outside.join("secret.txt"))
    );
    assert_eq!(fs::read_dir(&outside).unwrap().count(), 1);
    assert!(!pki.path("pub/x").exists());
    // An unknown export, and no export at all, are named as such.
    let r = run(
        &pki,
        "ls",
        &with_token(&token, &[os(&server.url("nothere"))]),
    );
    r.assert_code(8);
    assert!(r.stderr.contains("no such export"), "{}", r.stderr);
    let r = run(&pki, "ls", &with_token(&token, &[os(&server.url(""))]));
    assert!(r.stderr.contains("name an export"), "{}", r.stderr);
}
