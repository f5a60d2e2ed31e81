//! Mutual authentication with a shared secret, as two state machines, and the keys a
//! session derives from it.
//!
//! The secret never crosses the wire. The server greets every connection first with a
//! [`Hello`] carrying a nonce fresh for that connection, before it has read a byte, so
//! neither side waits on the other to start. On a control connection the client answers
//! with its own `Hello` and an HMAC over both nonces, both sides' feature bits and the
//! connection's *binding*; the server checks it and proves itself back, so a client cannot
//! be fooled by an impostor server either. Both then share a session key derived from the
//! secret, both nonces and the binding.
//!
//! The binding is what ties the proofs to one TLS connection: its keying-material exporter
//! (RFC 8446 section 7.5), which differs on the two halves of a connection that a
//! man in the middle terminated, even one holding a certificate the client accepted. A
//! session without encryption binds to nothing (all zeros) and relies on the nonces alone.
//!
//! A data channel proves it belongs to a session with an HMAC under that key over the
//! session id, its channel index, the nonce the server sent *on that data connection* and
//! that connection's own binding. A join captured on the path is therefore worthless on
//! any other connection: replayed ahead of the real one or after it, it fails on the
//! replayer's connection and leaves the real one alone.
//!
//! [`Authenticated`] also derives the keys that authenticate a session that runs without
//! encryption (`--no-encryption`): one per direction for control frames, one per sending
//! side for blocks. They come from the session key through HMAC with distinct labels, so
//! none of them says anything about another or about the secret.
//!
//! A client that authenticates with a credential instead (a bearer token, or the X.509
//! certificate it presented in TLS) says so with [`features::CREDENTIAL`] and runs the same
//! proofs keyed by a public constant: what makes them secret is the binding, which only
//! the two ends of the TLS connection know, so the session key and channel joins are as
//! good as that connection; the credential follows the proof inside TLS, and the server
//! decides on it. Both machines refuse this on a connection without TLS, where the binding
//! is all zeros and anyone could compute the key.
//!
//! Order on a control connection: server `Hello` and client `Hello` (both at once), client
//! `AuthProof`, server `AuthOk` (or `Error` with [`FailureClass::Auth`]). The caller
//! supplies nonces and the binding, so tests are deterministic; in production nonces come
//! from the OS random source.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::{features, ErrorMsg, FailureClass, Hello, Message, PROTOCOL_VERSION};

type HmacSha256 = Hmac<Sha256>;

const CLIENT_LABEL: &[u8] = b"wanxfer/6 client proof";
const SERVER_LABEL: &[u8] = b"wanxfer/6 server proof";
const SESSION_KEY_LABEL: &[u8] = b"wanxfer/6 session key";
const CHANNEL_LABEL: &[u8] = b"wanxfer/6 channel proof";
const CONTROL_KEY_LABEL: &[u8] = b"wanxfer/6 control frames from the";
const BLOCK_KEY_LABEL: &[u8] = b"wanxfer/6 blocks from the";
/// The "secret" of a client that authenticates with a credential: public, so that only
/// the TLS binding keys its proofs and session.
const CREDENTIAL_KEY: &[u8] = b"wanxfer/6 credential client: keyed by the TLS binding";
const GRANT_KEY_LABEL: &[u8] = b"wanxfer/6 third-party grant";
const SESSION_ID_LABEL: &[u8] = b"wanxfer/6 session id";

/// What ties a handshake to the connection it runs on: a TLS connection's exporter
/// output, or [`NO_BINDING`] on a connection without encryption.
pub type Binding = [u8; 32];

/// The binding of a connection without TLS.
pub const NO_BINDING: Binding = [0; 32];

/// The label under which both sides export a TLS connection's binding.
pub const BINDING_EXPORTER_LABEL: &[u8] = b"EXPORTER-wanxfer/6 connection binding";

/// Which side of a session sends: control keys and block keys come one per side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Client,
    Server,
}

impl Side {
    fn label(self) -> &'static [u8] {
        match self {
            Side::Client => b" client",
            Side::Server => b" server",
        }
    }
}

/// Why a handshake did not complete.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    #[error("authentication failed: the shared secrets differ")]
    BadProof,
    #[error("peer refused: {0}")]
    Refused(String),
    /// The server would not authenticate this client, and said why in its own words:
    /// the secrets differ, or this address failed too often and must wait. (A client
    /// with the right secret, turned away for a while, must not be told it is wrong.)
    #[error("{0}")]
    Denied(String),
    #[error("peer speaks protocol version {0}, this build speaks {PROTOCOL_VERSION}")]
    Version(u16),
    #[error("unexpected {0} during the handshake")]
    Unexpected(&'static str),
    /// A credential (token or certificate) offered or asked for on a connection without
    /// TLS, where it would be readable and the session key computable by anyone.
    #[error("a token or certificate is only accepted over TLS: drop --no-encryption")]
    CredentialWithoutTls,
    /// The client offered a credential to a server that takes only the shared secret.
    #[error("the server accepts only the shared secret, not tokens or certificates")]
    NoCredentials,
    /// The client proved the shared secret to a server that has none: its exports name
    /// only tokens and certificates.
    #[error(
        "the server takes no shared secret: authenticate with a bearer token (--token) or \
         a client certificate (--cert and --key)"
    )]
    NoSecret,
}

/// What a side does next.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    Send(Message),
    /// Nothing to send; wait for the peer's next message.
    Wait,
    /// Send this message, then the handshake is complete.
    SendAndDone(Message, Authenticated),
    Done(Authenticated),
}

/// The result of a completed handshake: what both sides now share.
#[derive(Clone, PartialEq, Eq)]
pub struct Authenticated {
    session_key: [u8; 32],
    /// What this side offered.
    pub features: u64,
    /// What the peer offered.
    pub peer_features: u64,
}

impl std::fmt::Debug for Authenticated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticated")
            .field("features", &self.features)
            .field("peer_features", &self.peer_features)
            .finish_non_exhaustive()
    }
}

impl Authenticated {
    fn new(
        secret: &[u8],
        client_nonce: &[u8; 32],
        server_nonce: &[u8; 32],
        binding: &Binding,
    ) -> Self {
        Authenticated {
            session_key: mac(
                secret,
                SESSION_KEY_LABEL,
                &[client_nonce, server_nonce, binding],
            ),
            features: 0,
            peer_features: 0,
        }
    }

    /// The features the session uses: those both sides offered.
    pub fn negotiated(&self) -> u64 {
        features::negotiate(self.features, self.peer_features)
    }

    /// The proof a data channel presents to join `session_id` as channel `index` on the
    /// connection whose server greeting carried `join_nonce` and whose own binding (its
    /// TLS exporter, not the control connection's) is `binding`.
    pub fn channel_proof(
        &self,
        session_id: &[u8; 16],
        index: u16,
        join_nonce: &[u8; 32],
        binding: &Binding,
    ) -> [u8; 32] {
        mac(
            &self.session_key,
            CHANNEL_LABEL,
            &[session_id, &index.to_le_bytes(), join_nonce, binding],
        )
    }

    /// Checks a joining channel's proof in constant time.
    pub fn verify_channel(
        &self,
        session_id: &[u8; 16],
        index: u16,
        join_nonce: &[u8; 32],
        binding: &Binding,
        proof: &[u8; 32],
    ) -> bool {
        self.channel_proof(session_id, index, join_nonce, binding)
            .ct_eq(proof)
            .into()
    }

    /// The id of the session this handshake opens: known to the client as soon as it
    /// has sent its proof, so that its data connections can join before the server's
    /// answer ([`features::PULL_PIPELINE`]); as unguessable as the key it comes from.
    pub fn session_id(&self) -> [u8; 16] {
        let full = mac(&self.session_key, SESSION_ID_LABEL, &[]);
        let mut id = [0; 16];
        id.copy_from_slice(&full[..16]);
        id
    }

    /// The key that authenticates control frames `from` one side, in a session without
    /// encryption.
    pub fn control_key(&self, from: Side) -> [u8; 32] {
        mac(&self.session_key, CONTROL_KEY_LABEL, &[from.label()])
    }

    /// The key that authenticates the blocks `from` one side sends, in a session without
    /// encryption.
    pub fn block_key(&self, from: Side) -> [u8; 32] {
        mac(&self.session_key, BLOCK_KEY_LABEL, &[from.label()])
    }
}

/// The proof one side gives: both nonces, both sides' features (so that nobody on the
/// path can strip one unnoticed) and the connection's binding.
fn proof(
    secret: &[u8],
    label: &[u8],
    client: &Hello,
    server_nonce: &[u8; 32],
    server_features: u64,
    binding: &Binding,
) -> [u8; 32] {
    mac(
        secret,
        label,
        &[
            &client.nonce,
            server_nonce,
            &client.features.to_le_bytes(),
            &server_features.to_le_bytes(),
            binding,
        ],
    )
}

fn mac(key: &[u8], label: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    m.update(label);
    for part in parts {
        m.update(part);
    }
    m.finalize().into_bytes().into()
}

/// The key a grant's proofs are made with: its secret bound to its id, and kept apart
/// from any shared secret by its own label.
pub fn grant_key(grant_id: &[u8; 16], grant_secret: &[u8; 32]) -> [u8; 32] {
    mac(grant_secret, GRANT_KEY_LABEL, &[grant_id])
}

/// The `Hello` either side sends.
pub fn hello(nonce: [u8; 32], features: u64) -> Message {
    Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        features,
        nonce,
        software: format!("wanxfer {}", env!("CARGO_PKG_VERSION")).into_bytes(),
    })
}

fn refused(msg: &ErrorMsg) -> HandshakeError {
    let text = String::from_utf8_lossy(&msg.message).into_owned();
    match msg.class {
        FailureClass::Auth => HandshakeError::Denied(text),
        _ => HandshakeError::Refused(text),
    }
}

fn check_version(h: &Hello) -> Result<(), HandshakeError> {
    if h.version != PROTOCOL_VERSION {
        return Err(HandshakeError::Version(h.version));
    }
    Ok(())
}

fn proof_expected(secret: &[u8], client: &Hello, server: &Hello, binding: &Binding) -> [u8; 32] {
    proof(
        secret,
        SERVER_LABEL,
        client,
        &server.nonce,
        server.features,
        binding,
    )
}

/// The client side of a control connection.
pub struct ClientHandshake {
    secret: Vec<u8>,
    client_nonce: [u8; 32],
    features: u64,
    binding: Binding,
    /// Proving a third-party grant (its id) rather than the shared secret.
    grant: Option<[u8; 16]>,
    state: ClientState,
}

enum ClientState {
    AwaitHello,
    AwaitOk(Authenticated, [u8; 32]),
    Done,
}

impl ClientHandshake {
    pub fn new(secret: &[u8], client_nonce: [u8; 32], features: u64) -> Self {
        ClientHandshake {
            secret: secret.to_vec(),
            client_nonce,
            features,
            binding: NO_BINDING,
            grant: None,
            state: ClientState::AwaitHello,
        }
    }

    /// A client proving a third-party grant instead of the shared secret: everything
    /// runs as with a secret, keyed by [`grant_key`], and the proof goes out as a
    /// [`Message::GrantProof`] naming the grant, so that the server knows which key to
    /// check it with.
    pub fn for_grant(
        grant_id: [u8; 16],
        grant_secret: &[u8; 32],
        client_nonce: [u8; 32],
        features: u64,
    ) -> Self {
        let mut handshake =
            ClientHandshake::new(&grant_key(&grant_id, grant_secret), client_nonce, features);
        handshake.grant = Some(grant_id);
        handshake
    }

    /// Binds the proofs to the connection (its TLS exporter output).
    pub fn with_binding(mut self, binding: Binding) -> Self {
        self.binding = binding;
        self
    }

    /// A client that authenticates with a credential, sent after the proof, rather than
    /// the shared secret (which it need not have).
    pub fn with_credential(mut self) -> Self {
        self.secret = CREDENTIAL_KEY.to_vec();
        self.features |= features::CREDENTIAL;
        self
    }

    /// The first message to send, at once: it does not depend on the server's greeting.
    pub fn hello(&self) -> Message {
        hello(self.client_nonce, self.features)
    }

    /// Once the proof is sent: what both sides will share if the server proves itself
    /// too. A session without encryption needs its keys to authenticate the request it
    /// sends with the proof, before the server's answer arrives.
    pub fn pending(&self) -> Option<&Authenticated> {
        match &self.state {
            ClientState::AwaitOk(auth, _) => Some(auth),
            _ => None,
        }
    }

    pub fn handle(&mut self, msg: Message) -> Result<Step, HandshakeError> {
        match (&self.state, msg) {
            (_, Message::Error(e)) => Err(refused(&e)),
            (ClientState::AwaitHello, Message::Hello(h)) => {
                check_version(&h)?;
                if self.features & features::CREDENTIAL != 0 {
                    if self.binding == NO_BINDING {
                        return Err(HandshakeError::CredentialWithoutTls);
                    }
                    if h.features & features::CREDENTIAL == 0 {
                        return Err(HandshakeError::NoCredentials);
                    }
                }
                let mut auth =
                    Authenticated::new(&self.secret, &self.client_nonce, &h.nonce, &self.binding);
                auth.features = self.features;
                auth.peer_features = h.features;
                let ours = self.hello();
                let Message::Hello(ours) = ours else {
                    unreachable!("hello() makes a Hello")
                };
                let proof = proof(
                    &self.secret,
                    CLIENT_LABEL,
                    &ours,
                    &h.nonce,
                    h.features,
                    &self.binding,
                );
                let expected = proof_expected(&self.secret, &ours, &h, &self.binding);
                self.state = ClientState::AwaitOk(auth, expected);
                Ok(Step::Send(match self.grant {
                    None => Message::AuthProof { mac: proof },
                    Some(grant_id) => Message::GrantProof {
                        grant_id,
                        mac: proof,
                    },
                }))
            }
            (ClientState::AwaitOk(auth, expected), Message::AuthOk { mac }) => {
                if !bool::from(expected.ct_eq(&mac)) {
                    return Err(HandshakeError::BadProof);
                }
                let auth = auth.clone();
                self.state = ClientState::Done;
                Ok(Step::Done(auth))
            }
            _ => Err(HandshakeError::Unexpected("message")),
        }
    }
}

/// The server side of a control connection.
pub struct ServerHandshake {
    /// `None`: this server takes no shared secret, only credentials.
    secret: Option<Vec<u8>>,
    server_nonce: [u8; 32],
    features: u64,
    binding: Binding,
    state: ServerState,
}

enum ServerState {
    AwaitHello,
    AwaitProof(Hello),
    Done,
}

impl ServerHandshake {
    pub fn new(secret: &[u8], server_nonce: [u8; 32], features: u64) -> Self {
        Self::with_secret(Some(secret), server_nonce, features)
    }

    /// [`ServerHandshake::new`] for a server that may have no shared secret, so that
    /// only clients with a credential (a token, a certificate) get in.
    pub fn with_secret(secret: Option<&[u8]>, server_nonce: [u8; 32], features: u64) -> Self {
        ServerHandshake {
            secret: secret.map(<[u8]>::to_vec),
            server_nonce,
            features,
            binding: NO_BINDING,
            state: ServerState::AwaitHello,
        }
    }

    /// Binds the proofs to the connection (its TLS exporter output). Can be set once the
    /// TLS handshake completes, after the greeting went out but before the proof is read.
    pub fn set_binding(&mut self, binding: Binding) {
        self.binding = binding;
    }

    /// The greeting, sent as soon as the connection is accepted.
    pub fn hello(&self) -> Message {
        hello(self.server_nonce, self.features)
    }

    /// Feeds one client message. On a bad proof the error is returned; the caller sends
    /// [`ServerHandshake::auth_failed`] and closes, having touched nothing.
    pub fn handle(&mut self, msg: Message) -> Result<Step, HandshakeError> {
        match (&self.state, msg) {
            (ServerState::AwaitHello, Message::Hello(h)) => {
                check_version(&h)?;
                self.state = ServerState::AwaitProof(h);
                Ok(Step::Wait)
            }
            (ServerState::AwaitProof(h), Message::AuthProof { mac: given }) => {
                if h.features & features::CREDENTIAL != 0 {
                    if self.features & features::CREDENTIAL == 0 {
                        return Err(HandshakeError::NoCredentials);
                    }
                    if self.binding == NO_BINDING {
                        return Err(HandshakeError::CredentialWithoutTls);
                    }
                    // From here on the proofs are keyed by the binding alone; who the
                    // client is, the credential that follows says.
                    self.secret = Some(CREDENTIAL_KEY.to_vec());
                }
                let Some(secret) = self.secret.clone() else {
                    return Err(HandshakeError::NoSecret);
                };
                self.check_proof(&secret, &given)
            }
            _ => Err(HandshakeError::Unexpected("message")),
        }
    }

    /// Feeds a client's [`Message::GrantProof`] instead of [`ServerHandshake::handle`]:
    /// the caller looks the grant up and passes its secret (`None` when no live grant has
    /// that id, which fails the proof like a wrong one).
    pub fn handle_grant(
        &mut self,
        grant_id: &[u8; 16],
        given: &[u8; 32],
        grant_secret: Option<&[u8; 32]>,
    ) -> Result<Step, HandshakeError> {
        if !matches!(self.state, ServerState::AwaitProof(_)) {
            return Err(HandshakeError::Unexpected("grant proof"));
        }
        let Some(grant_secret) = grant_secret else {
            return Err(HandshakeError::BadProof);
        };
        self.check_proof(&grant_key(grant_id, grant_secret), given)
    }

    /// Checks the client's proof made with `secret`; proves this side with it back.
    fn check_proof(&mut self, secret: &[u8], given: &[u8; 32]) -> Result<Step, HandshakeError> {
        let ServerState::AwaitProof(h) = &self.state else {
            return Err(HandshakeError::Unexpected("proof"));
        };
        let expected = proof(
            secret,
            CLIENT_LABEL,
            h,
            &self.server_nonce,
            self.features,
            &self.binding,
        );
        if !bool::from(expected.ct_eq(given)) {
            return Err(HandshakeError::BadProof);
        }
        let mut auth = Authenticated::new(secret, &h.nonce, &self.server_nonce, &self.binding);
        auth.features = self.features;
        auth.peer_features = h.features;
        let Message::Hello(ours) = self.hello() else {
            unreachable!("hello() makes a Hello")
        };
        let ok = Message::AuthOk {
            mac: proof_expected(secret, h, &ours, &self.binding),
        };
        self.state = ServerState::Done;
        Ok(Step::SendAndDone(ok, auth))
    }

    /// The message telling a client its proof was wrong.
    pub fn auth_failed() -> Message {
        Message::Error(ErrorMsg::new(
            FailureClass::Auth,
            "the shared secrets differ: check --secret-file or WANXFER_SECRET on both sides",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a whole control handshake; both sides' results.
    fn run(
        client_secret: &[u8],
        server_secret: &[u8],
    ) -> Result<(Authenticated, Authenticated), HandshakeError> {
        run_bound(client_secret, server_secret, NO_BINDING, NO_BINDING)
    }

    /// A control handshake where each side sees its own binding (equal on one TLS
    /// connection, different on the two halves of one a man in the middle terminated).
    fn run_bound(
        client_secret: &[u8],
        server_secret: &[u8],
        client_binding: Binding,
        server_binding: Binding,
    ) -> Result<(Authenticated, Authenticated), HandshakeError> {
        let mut c = ClientHandshake::new(client_secret, [1; 32], features::SUPPORTED)
            .with_binding(client_binding);
        let mut s = ServerHandshake::new(server_secret, [2; 32], features::COMPARE);
        s.set_binding(server_binding);
        let Step::Send(proof) = c.handle(s.hello())? else {
            panic!("client sends proof")
        };
        assert_eq!(s.handle(c.hello())?, Step::Wait);
        let (ok, server_auth) = match s.handle(proof) {
            Ok(Step::SendAndDone(ok, auth)) => (ok, auth),
            Ok(other) => panic!("unexpected {other:?}"),
            Err(e) => {
                let told = c.handle(ServerHandshake::auth_failed());
                assert!(matches!(told, Err(HandshakeError::Denied(_))), "{told:?}");
                return Err(e);
            }
        };
        let Step::Done(client_auth) = c.handle(ok)? else {
            panic!("client done")
        };
        Ok((client_auth, server_auth))
    }

    #[test]
    fn same_secret_authenticates_both_ways_and_features_are_intersected() {
        let (client, server) = run(b"s3cret", b"s3cret").unwrap();
        assert_eq!(client.negotiated(), features::COMPARE);
        assert_eq!(server.negotiated(), features::COMPARE);
    }

    #[test]
    fn wrong_secret_is_refused() {
        assert_eq!(
            run(b"wrong", b"s3cret").unwrap_err(),
            HandshakeError::BadProof
        );
    }

    /// The regression of issue 16 item 9: a join proof is good only on the connection
    /// whose greeting carried its nonce, for its session and its index.
    #[test]
    fn a_channel_proof_is_bound_to_its_connection_session_and_index() {
        let (client, server) = run(b"s3cret", b"s3cret").unwrap();
        let b = [4; 32];
        let proof = client.channel_proof(&[5; 16], 3, &[9; 32], &b);
        assert!(server.verify_channel(&[5; 16], 3, &[9; 32], &b, &proof));
        assert!(
            !server.verify_channel(&[5; 16], 3, &[8; 32], &b, &proof),
            "another connection"
        );
        assert!(
            !server.verify_channel(&[5; 16], 3, &[9; 32], &[3; 32], &proof),
            "another TLS connection with the same greeting"
        );
        assert!(
            !server.verify_channel(&[5; 16], 4, &[9; 32], &b, &proof),
            "another index"
        );
        assert!(
            !server.verify_channel(&[6; 16], 3, &[9; 32], &b, &proof),
            "another session"
        );
        // Another control handshake with the same secret derives another key.
        let (other, _) = {
            let mut c = ClientHandshake::new(b"s3cret", [7; 32], 0);
            let s = ServerHandshake::new(b"s3cret", [2; 32], 0);
            let Ok(Step::Send(_)) = c.handle(s.hello()) else {
                panic!()
            };
            let ClientState::AwaitOk(auth, _) = &c.state else {
                panic!()
            };
            (auth.clone(), ())
        };
        let stolen = other.channel_proof(&[5; 16], 3, &[9; 32], &b);
        assert!(!server.verify_channel(&[5; 16], 3, &[9; 32], &b, &stolen));
    }

    /// A man in the middle who terminates TLS towards each side (say, with a certificate
    /// the client accepted on first use) sees two connections with two bindings: even
    /// relaying every message unchanged, the proofs fail.
    #[test]
    fn proofs_bound_to_different_connections_fail() {
        assert!(run_bound(b"s3cret", b"s3cret", [1; 32], [1; 32]).is_ok());
        assert_eq!(
            run_bound(b"s3cret", b"s3cret", [1; 32], [2; 32]).unwrap_err(),
            HandshakeError::BadProof
        );
        let (plain, _) = run(b"s3cret", b"s3cret").unwrap();
        let (bound, _) = run_bound(b"s3cret", b"s3cret", [1; 32], [1; 32]).unwrap();
        assert_ne!(plain.session_key, bound.session_key);
    }

    /// Feature bits are covered by the proofs: stripping one on the path (to turn off a
    /// check) fails the handshake instead of weakening the session.
    #[test]
    fn a_feature_bit_changed_on_the_path_fails_the_proof() {
        let mut c = ClientHandshake::new(b"s3cret", [1; 32], features::SUPPORTED);
        let mut s = ServerHandshake::new(b"s3cret", [2; 32], features::SUPPORTED);
        let Message::Hello(mut tampered) = c.hello() else {
            unreachable!()
        };
        tampered.features &= !features::COMPARE;
        let Step::Send(proof) = c.handle(s.hello()).unwrap() else {
            panic!()
        };
        s.handle(Message::Hello(tampered)).unwrap();
        assert_eq!(s.handle(proof), Err(HandshakeError::BadProof));
    }

    /// Both sides derive the same keys, distinct per purpose and direction, and distinct
    /// from one session to the next.
    #[test]
    fn derived_keys_agree_and_are_distinct() {
        let (client, server) = run(b"s3cret", b"s3cret").unwrap();
        let keys = [
            client.control_key(Side::Client),
            client.control_key(Side::Server),
            client.block_key(Side::Client),
            client.block_key(Side::Server),
        ];
        assert_eq!(keys[0], server.control_key(Side::Client));
        assert_eq!(keys[1], server.control_key(Side::Server));
        assert_eq!(keys[2], server.block_key(Side::Client));
        assert_eq!(keys[3], server.block_key(Side::Server));
        for (i, a) in keys.iter().enumerate() {
            for b in &keys[i + 1..] {
                assert_ne!(a, b);
            }
            assert_ne!(a, &client.session_key);
        }
        let (other, _) = run_bound(b"s3cret", b"s3cret", [8; 32], [8; 32]).unwrap();
        assert_ne!(other.block_key(Side::Client), keys[2]);
        // The session's id too, which the client knows once its proof is out.
        assert_eq!(client.session_id(), server.session_id());
        assert_ne!(other.session_id(), client.session_id());
        assert_ne!(&client.session_id()[..], &client.session_key[..16]);
        let mut c = ClientHandshake::new(b"s3cret", [1; 32], 0);
        let mut s = ServerHandshake::new(b"s3cret", [2; 32], 0);
        let Step::Send(proof) = c.handle(s.hello()).unwrap() else {
            panic!()
        };
        let early = c.pending().expect("the proof is out").session_id();
        s.handle(c.hello()).unwrap();
        let Step::SendAndDone(_, server) = s.handle(proof).unwrap() else {
            panic!()
        };
        assert_eq!(early, server.session_id());
    }

    /// A grant's proof passes only with that grant's secret under that id, and a shared
    /// secret's proof is no grant proof (nor the other way round).
    #[test]
    fn a_grant_proof_needs_the_grant_it_names() {
        let run_grant = |given_id: [u8; 16], held: Option<&[u8; 32]>| {
            let mut c = ClientHandshake::for_grant(given_id, &[5; 32], [1; 32], 0);
            let mut s = ServerHandshake::new(b"shared", [2; 32], 0);
            let Step::Send(proof) = c.handle(s.hello()).unwrap() else {
                panic!()
            };
            s.handle(c.hello()).unwrap();
            let Message::GrantProof { grant_id, mac } = proof else {
                panic!("a grant proof, got {proof:?}")
            };
            assert_eq!(grant_id, given_id);
            let step = s.handle_grant(&[9; 16], &mac, held)?;
            let Step::SendAndDone(ok, server) = step else {
                panic!()
            };
            let Step::Done(client) = c.handle(ok)? else {
                panic!()
            };
            assert_eq!(client.session_key, server.session_key);
            Ok::<_, HandshakeError>(())
        };
        assert_eq!(run_grant([9; 16], Some(&[5; 32])), Ok(()));
        assert_eq!(
            run_grant([9; 16], Some(&[6; 32])),
            Err(HandshakeError::BadProof)
        );
        assert_eq!(run_grant([9; 16], None), Err(HandshakeError::BadProof));
        assert_eq!(
            run_grant([8; 16], Some(&[5; 32])),
            Err(HandshakeError::BadProof),
            "a proof made for another id"
        );
        // The shared secret's proof handed in as a grant's fails, and vice versa.
        let mut c = ClientHandshake::new(&[5; 32], [1; 32], 0);
        let mut s = ServerHandshake::new(&[5; 32], [2; 32], 0);
        let Step::Send(Message::AuthProof { mac }) = c.handle(s.hello()).unwrap() else {
            panic!()
        };
        s.handle(c.hello()).unwrap();
        assert_eq!(
            s.handle_grant(&[9; 16], &mac, Some(&[5; 32])),
            Err(HandshakeError::BadProof)
        );
    }

    #[test]
    fn impostor_server_is_detected() {
        let mut c = ClientHandshake::new(b"s3cret", [1; 32], 0);
        let s = ServerHandshake::new(b"s3cret", [2; 32], 0);
        c.handle(s.hello()).unwrap();
        let forged = Message::AuthOk { mac: [0; 32] };
        assert_eq!(c.handle(forged), Err(HandshakeError::BadProof));
    }

    #[test]
    fn proof_before_hello_is_unexpected() {
        let mut s = ServerHandshake::new(b"x", [2; 32], 0);
        assert!(matches!(
            s.handle(Message::AuthProof { mac: [0; 32] }),
            Err(HandshakeError::Unexpected(_))
        ));
    }

    #[test]
    fn another_version_is_named() {
        let mut s = ServerHandshake::new(b"x", [2; 32], 0);
        let Message::Hello(mut h) = hello([1; 32], 0) else {
            unreachable!()
        };
        h.version = 4;
        assert_eq!(s.handle(Message::Hello(h)), Err(HandshakeError::Version(4)));
    }

    fn credential_run(
        client_binding: Binding,
        server_binding: Binding,
        server_features: u64,
    ) -> Result<(Authenticated, Authenticated), HandshakeError> {
        let mut c = ClientHandshake::new(b"", [1; 32], features::SUPPORTED)
            .with_binding(client_binding)
            .with_credential();
        let mut s = ServerHandshake::new(b"the real secret", [2; 32], server_features);
        s.set_binding(server_binding);
        let Step::Send(proof) = c.handle(s.hello())? else {
            panic!("client sends proof")
        };
        assert_eq!(s.handle(c.hello())?, Step::Wait);
        let Step::SendAndDone(ok, server_auth) = s.handle(proof)? else {
            panic!("server done")
        };
        let Step::Done(client_auth) = c.handle(ok)? else {
            panic!("client done")
        };
        Ok((client_auth, server_auth))
    }

    /// A credential client needs no secret: both ends of one TLS connection agree on the
    /// session key; anyone else (another connection, a man in the middle) does not.
    #[test]
    fn a_credential_client_is_keyed_by_its_tls_connection() {
        let both = features::SUPPORTED | features::CREDENTIAL;
        let (client, server) = credential_run([3; 32], [3; 32], both).unwrap();
        assert_eq!(client.session_key, server.session_key);
        assert_ne!(server.peer_features & features::CREDENTIAL, 0);
        let (other, _) = credential_run([4; 32], [4; 32], both).unwrap();
        assert_ne!(other.session_key, client.session_key);
        assert_eq!(
            credential_run([3; 32], [5; 32], both).unwrap_err(),
            HandshakeError::BadProof
        );
    }

    /// A server without a shared secret lets credential clients in and tells a secret
    /// client why it may not, rather than that its secret is wrong.
    #[test]
    fn a_server_without_a_secret_takes_credentials_only() {
        let both = features::SUPPORTED | features::CREDENTIAL;
        let mut c = ClientHandshake::new(b"", [1; 32], features::SUPPORTED)
            .with_binding([3; 32])
            .with_credential();
        let mut s = ServerHandshake::with_secret(None, [2; 32], both);
        s.set_binding([3; 32]);
        let Ok(Step::Send(proof)) = c.handle(s.hello()) else {
            panic!("client sends proof")
        };
        s.handle(c.hello()).unwrap();
        assert!(matches!(s.handle(proof), Ok(Step::SendAndDone(..))));

        for secret in [&b""[..], b"any secret at all"] {
            let mut c =
                ClientHandshake::new(secret, [1; 32], features::SUPPORTED).with_binding([3; 32]);
            let mut s = ServerHandshake::with_secret(None, [2; 32], both);
            s.set_binding([3; 32]);
            let Ok(Step::Send(proof)) = c.handle(s.hello()) else {
                panic!("client sends proof")
            };
            s.handle(c.hello()).unwrap();
            assert_eq!(s.handle(proof), Err(HandshakeError::NoSecret));
        }
    }

    #[test]
    fn a_credential_is_refused_without_tls_or_by_a_secret_only_server() {
        let both = features::SUPPORTED | features::CREDENTIAL;
        assert_eq!(
            credential_run(NO_BINDING, NO_BINDING, both).unwrap_err(),
            HandshakeError::CredentialWithoutTls
        );
        assert_eq!(
            credential_run([3; 32], [3; 32], features::SUPPORTED).unwrap_err(),
            HandshakeError::NoCredentials
        );
        // A server sees the same even if the client's check were skipped.
        let mut s = ServerHandshake::new(b"x", [2; 32], both);
        let Message::Hello(mut h) = hello([1; 32], features::CREDENTIAL) else {
            unreachable!()
        };
        h.features |= features::CREDENTIAL;
        s.handle(Message::Hello(h)).unwrap();
        assert_eq!(
            s.handle(Message::AuthProof { mac: [0; 32] }),
            Err(HandshakeError::CredentialWithoutTls)
        );
    }

    /// The secret-keyed proof of a credential client never passes for a secret client's.
    #[test]
    fn a_secret_server_does_not_take_a_credential_proof_for_a_secret_one() {
        let mut c = ClientHandshake::new(b"", [1; 32], features::SUPPORTED)
            .with_binding([3; 32])
            .with_credential();
        let mut s = ServerHandshake::new(b"s3cret", [2; 32], features::SUPPORTED);
        s.set_binding([3; 32]);
        let Step::Send(proof) = c
            .handle(hello([2; 32], features::SUPPORTED | features::CREDENTIAL))
            .unwrap()
        else {
            panic!()
        };
        let Message::Hello(mut stripped) = c.hello() else {
            unreachable!()
        };
        stripped.features &= !features::CREDENTIAL;
        s.handle(Message::Hello(stripped)).unwrap();
        assert_eq!(s.handle(proof), Err(HandshakeError::BadProof));
    }
}
