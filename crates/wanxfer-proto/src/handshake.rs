//! Mutual authentication with a shared secret, as two state machines.
//!
//! The secret never crosses the wire: each side sends a fresh nonce, the client proves
//! knowledge of the secret with an HMAC over both nonces, and the server proves it back,
//! so a client cannot be fooled by an impostor server either. Data channels join a session
//! with a proof bound to that session's nonces and id, so a channel cannot be attached to
//! someone else's session without the secret. Confidentiality is TLS's job (a later
//! feature bit); this handshake only decides who may make the server touch its disk.
//!
//! Order: client `Hello` → server `Hello` → client `AuthProof` → server `AuthOk` (or
//! `Error` with [`FailureClass::Auth`]). The caller supplies nonces, so tests are
//! deterministic; in production they come from the OS random source.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::{ErrorMsg, FailureClass, Hello, Message, PROTOCOL_VERSION};

type HmacSha256 = Hmac<Sha256>;

const CLIENT_LABEL: &[u8] = b"wanxfer/1 client proof";
const SERVER_LABEL: &[u8] = b"wanxfer/1 server proof";
const CHANNEL_LABEL: &[u8] = b"wanxfer/1 channel proof";

/// Why a handshake did not complete.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    #[error("authentication failed: the shared secrets differ")]
    BadProof,
    #[error("peer refused: {0}")]
    Refused(String),
    #[error("peer speaks protocol version {0}, this build speaks {PROTOCOL_VERSION}")]
    Version(u16),
    #[error("unexpected {0} during the handshake")]
    Unexpected(&'static str),
}

/// What a side does next.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    Send(Message),
    /// Send this message, then the handshake is complete.
    SendAndDone(Message, Authenticated),
    Done(Authenticated),
}

/// The result of a completed handshake: what both sides now share.
#[derive(Clone, PartialEq, Eq)]
pub struct Authenticated {
    secret: Vec<u8>,
    client_nonce: [u8; 32],
    server_nonce: [u8; 32],
    pub peer_features: u64,
}

impl std::fmt::Debug for Authenticated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticated")
            .field("peer_features", &self.peer_features)
            .finish_non_exhaustive()
    }
}

impl Authenticated {
    /// The proof a data channel presents to join `session_id` as channel `index`.
    pub fn channel_proof(&self, session_id: &[u8; 16], index: u16) -> [u8; 32] {
        self.mac(CHANNEL_LABEL, &[session_id, &index.to_le_bytes()])
    }

    /// Checks a joining channel's proof in constant time.
    pub fn verify_channel(&self, session_id: &[u8; 16], index: u16, proof: &[u8; 32]) -> bool {
        self.channel_proof(session_id, index).ct_eq(proof).into()
    }

    fn mac(&self, label: &[u8], extra: &[&[u8]]) -> [u8; 32] {
        mac(
            &self.secret,
            label,
            &self.client_nonce,
            &self.server_nonce,
            extra,
        )
    }
}

fn mac(
    secret: &[u8],
    label: &[u8],
    client_nonce: &[u8; 32],
    server_nonce: &[u8; 32],
    extra: &[&[u8]],
) -> [u8; 32] {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(label);
    m.update(client_nonce);
    m.update(server_nonce);
    for part in extra {
        m.update(part);
    }
    m.finalize().into_bytes().into()
}

fn hello(nonce: [u8; 32], features: u64) -> Message {
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
        FailureClass::Auth => HandshakeError::BadProof,
        _ => HandshakeError::Refused(text),
    }
}

/// The client side.
pub struct ClientHandshake {
    auth: Authenticated,
    features: u64,
    state: ClientState,
}

#[derive(Debug, PartialEq, Eq)]
enum ClientState {
    AwaitHello,
    AwaitOk,
    Done,
}

impl ClientHandshake {
    pub fn new(secret: &[u8], client_nonce: [u8; 32], features: u64) -> Self {
        ClientHandshake {
            auth: Authenticated {
                secret: secret.to_vec(),
                client_nonce,
                server_nonce: [0; 32],
                peer_features: 0,
            },
            features,
            state: ClientState::AwaitHello,
        }
    }

    /// The first message to send.
    pub fn hello(&self) -> Message {
        hello(self.auth.client_nonce, self.features)
    }

    pub fn handle(&mut self, msg: Message) -> Result<Step, HandshakeError> {
        match (&self.state, msg) {
            (_, Message::Error(e)) => Err(refused(&e)),
            (ClientState::AwaitHello, Message::Hello(h)) => {
                if h.version != PROTOCOL_VERSION {
                    return Err(HandshakeError::Version(h.version));
                }
                self.auth.server_nonce = h.nonce;
                self.auth.peer_features = h.features;
                self.state = ClientState::AwaitOk;
                Ok(Step::Send(Message::AuthProof {
                    mac: self.auth.mac(CLIENT_LABEL, &[]),
                }))
            }
            (ClientState::AwaitOk, Message::AuthOk { mac }) => {
                let expected = self.auth.mac(SERVER_LABEL, &[]);
                if !bool::from(expected.ct_eq(&mac)) {
                    return Err(HandshakeError::BadProof);
                }
                self.state = ClientState::Done;
                Ok(Step::Done(self.auth.clone()))
            }
            _ => Err(HandshakeError::Unexpected("message")),
        }
    }
}

/// The server side.
pub struct ServerHandshake {
    auth: Authenticated,
    features: u64,
    state: ServerState,
}

#[derive(Debug, PartialEq, Eq)]
enum ServerState {
    AwaitHello,
    AwaitProof,
    Done,
}

impl ServerHandshake {
    pub fn new(secret: &[u8], server_nonce: [u8; 32], features: u64) -> Self {
        ServerHandshake {
            auth: Authenticated {
                secret: secret.to_vec(),
                client_nonce: [0; 32],
                server_nonce,
                peer_features: 0,
            },
            features,
            state: ServerState::AwaitHello,
        }
    }

    /// Feeds one client message. On a bad proof the error is returned; the caller sends
    /// [`ServerHandshake::auth_failed`] and closes, having touched nothing.
    pub fn handle(&mut self, msg: Message) -> Result<Step, HandshakeError> {
        match (&self.state, msg) {
            (ServerState::AwaitHello, Message::Hello(h)) => {
                if h.version != PROTOCOL_VERSION {
                    return Err(HandshakeError::Version(h.version));
                }
                self.auth.client_nonce = h.nonce;
                self.auth.peer_features = h.features;
                self.state = ServerState::AwaitProof;
                Ok(Step::Send(hello(self.auth.server_nonce, self.features)))
            }
            (ServerState::AwaitProof, Message::AuthProof { mac }) => {
                let expected = self.auth.mac(CLIENT_LABEL, &[]);
                if !bool::from(expected.ct_eq(&mac)) {
                    return Err(HandshakeError::BadProof);
                }
                self.state = ServerState::Done;
                let ok = Message::AuthOk {
                    mac: self.auth.mac(SERVER_LABEL, &[]),
                };
                Ok(Step::SendAndDone(ok, self.auth.clone()))
            }
            _ => Err(HandshakeError::Unexpected("message")),
        }
    }

    /// The message telling a client its proof was wrong.
    pub fn auth_failed() -> Message {
        Message::Error(ErrorMsg::new(
            FailureClass::Auth,
            "authentication failed: check the shared secret (--secret-file or WANXFER_SECRET)",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(client_secret: &[u8], server_secret: &[u8]) -> Result<(), HandshakeError> {
        let mut c = ClientHandshake::new(client_secret, [1; 32], 0);
        let mut s = ServerHandshake::new(server_secret, [2; 32], 0);
        let Step::Send(server_hello) = s.handle(c.hello())? else {
            panic!("server answers hello")
        };
        let Step::Send(proof) = c.handle(server_hello)? else {
            panic!("client sends proof")
        };
        let (ok, server_auth) = match s.handle(proof) {
            Ok(Step::SendAndDone(ok, auth)) => (ok, auth),
            Ok(other) => panic!("unexpected {other:?}"),
            Err(e) => {
                c.handle(ServerHandshake::auth_failed())?;
                return Err(e);
            }
        };
        let Step::Done(client_auth) = c.handle(ok)? else {
            panic!("client done")
        };
        let proof = client_auth.channel_proof(&[5; 16], 3);
        assert!(server_auth.verify_channel(&[5; 16], 3, &proof));
        assert!(!server_auth.verify_channel(&[5; 16], 4, &proof));
        assert!(!server_auth.verify_channel(&[6; 16], 3, &proof));
        Ok(())
    }

    #[test]
    fn same_secret_authenticates_both_ways() {
        run(b"s3cret", b"s3cret").unwrap();
    }

    #[test]
    fn wrong_secret_is_refused() {
        assert_eq!(run(b"wrong", b"s3cret"), Err(HandshakeError::BadProof));
    }

    #[test]
    fn impostor_server_is_detected() {
        let mut c = ClientHandshake::new(b"s3cret", [1; 32], 0);
        let mut s = ServerHandshake::new(b"s3cret", [2; 32], 0);
        let Ok(Step::Send(h)) = s.handle(c.hello()) else {
            panic!()
        };
        c.handle(h).unwrap();
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
}
