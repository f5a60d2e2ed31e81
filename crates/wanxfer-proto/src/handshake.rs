//! Mutual authentication with a shared secret, as two state machines.
//!
//! The secret never crosses the wire. The server greets every connection first with a
//! [`Hello`] carrying a nonce fresh for that connection, before it has read a byte, so
//! neither side waits on the other to start. On a control connection the client answers
//! with its own `Hello` and an HMAC over both nonces; the server checks it and proves
//! itself back, so a client cannot be fooled by an impostor server either. Both then
//! share a session key derived from the secret and both nonces.
//!
//! A data channel proves it belongs to a session with an HMAC under that key over the
//! session id, its channel index and the nonce the server sent *on that data connection*.
//! A join captured on the path is therefore worthless on any other connection: replayed
//! ahead of the real one or after it, it fails on the replayer's connection and leaves
//! the real one alone. Confidentiality is TLS's job (a later feature bit); this handshake
//! only decides who may make the server touch its disk.
//!
//! Order on a control connection: server `Hello` and client `Hello` (both at once), client
//! `AuthProof`, server `AuthOk` (or `Error` with [`FailureClass::Auth`]). The caller
//! supplies nonces, so tests are deterministic; in production they come from the OS random
//! source.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::{features, ErrorMsg, FailureClass, Hello, Message, PROTOCOL_VERSION};

type HmacSha256 = Hmac<Sha256>;

const CLIENT_LABEL: &[u8] = b"wanxfer/5 client proof";
const SERVER_LABEL: &[u8] = b"wanxfer/5 server proof";
const SESSION_KEY_LABEL: &[u8] = b"wanxfer/5 session key";
const CHANNEL_LABEL: &[u8] = b"wanxfer/5 channel proof";

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
    fn new(secret: &[u8], client_nonce: &[u8; 32], server_nonce: &[u8; 32]) -> Self {
        Authenticated {
            session_key: mac(secret, SESSION_KEY_LABEL, &[client_nonce, server_nonce]),
            features: 0,
            peer_features: 0,
        }
    }

    /// The features the session uses: those both sides offered.
    pub fn negotiated(&self) -> u64 {
        features::negotiate(self.features, self.peer_features)
    }

    /// The proof a data channel presents to join `session_id` as channel `index` on the
    /// connection whose server greeting carried `join_nonce`.
    pub fn channel_proof(
        &self,
        session_id: &[u8; 16],
        index: u16,
        join_nonce: &[u8; 32],
    ) -> [u8; 32] {
        mac(
            &self.session_key,
            CHANNEL_LABEL,
            &[session_id, &index.to_le_bytes(), join_nonce],
        )
    }

    /// Checks a joining channel's proof in constant time.
    pub fn verify_channel(
        &self,
        session_id: &[u8; 16],
        index: u16,
        join_nonce: &[u8; 32],
        proof: &[u8; 32],
    ) -> bool {
        self.channel_proof(session_id, index, join_nonce)
            .ct_eq(proof)
            .into()
    }
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

/// The client side of a control connection.
pub struct ClientHandshake {
    secret: Vec<u8>,
    client_nonce: [u8; 32],
    features: u64,
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
            state: ClientState::AwaitHello,
        }
    }

    /// The first message to send, at once: it does not depend on the server's greeting.
    pub fn hello(&self) -> Message {
        hello(self.client_nonce, self.features)
    }

    pub fn handle(&mut self, msg: Message) -> Result<Step, HandshakeError> {
        match (&self.state, msg) {
            (_, Message::Error(e)) => Err(refused(&e)),
            (ClientState::AwaitHello, Message::Hello(h)) => {
                check_version(&h)?;
                let mut auth = Authenticated::new(&self.secret, &self.client_nonce, &h.nonce);
                auth.features = self.features;
                auth.peer_features = h.features;
                let proof = mac(&self.secret, CLIENT_LABEL, &[&self.client_nonce, &h.nonce]);
                let expected = mac(&self.secret, SERVER_LABEL, &[&self.client_nonce, &h.nonce]);
                self.state = ClientState::AwaitOk(auth, expected);
                Ok(Step::Send(Message::AuthProof { mac: proof }))
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
    secret: Vec<u8>,
    server_nonce: [u8; 32],
    features: u64,
    state: ServerState,
}

enum ServerState {
    AwaitHello,
    AwaitProof(Hello),
    Done,
}

impl ServerHandshake {
    pub fn new(secret: &[u8], server_nonce: [u8; 32], features: u64) -> Self {
        ServerHandshake {
            secret: secret.to_vec(),
            server_nonce,
            features,
            state: ServerState::AwaitHello,
        }
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
            (ServerState::AwaitProof(h), Message::AuthProof { mac: proof }) => {
                let expected = mac(&self.secret, CLIENT_LABEL, &[&h.nonce, &self.server_nonce]);
                if !bool::from(expected.ct_eq(&proof)) {
                    return Err(HandshakeError::BadProof);
                }
                let mut auth = Authenticated::new(&self.secret, &h.nonce, &self.server_nonce);
                auth.features = self.features;
                auth.peer_features = h.features;
                let ok = Message::AuthOk {
                    mac: mac(&self.secret, SERVER_LABEL, &[&h.nonce, &self.server_nonce]),
                };
                self.state = ServerState::Done;
                Ok(Step::SendAndDone(ok, auth))
            }
            _ => Err(HandshakeError::Unexpected("message")),
        }
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
        let mut c = ClientHandshake::new(client_secret, [1; 32], features::SUPPORTED);
        let mut s = ServerHandshake::new(server_secret, [2; 32], features::COMPARE);
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
        let proof = client.channel_proof(&[5; 16], 3, &[9; 32]);
        assert!(server.verify_channel(&[5; 16], 3, &[9; 32], &proof));
        assert!(
            !server.verify_channel(&[5; 16], 3, &[8; 32], &proof),
            "another connection"
        );
        assert!(
            !server.verify_channel(&[5; 16], 4, &[9; 32], &proof),
            "another index"
        );
        assert!(
            !server.verify_channel(&[6; 16], 3, &[9; 32], &proof),
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
        let stolen = other.channel_proof(&[5; 16], 3, &[9; 32]);
        assert!(!server.verify_channel(&[5; 16], 3, &[9; 32], &stolen));
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
}
