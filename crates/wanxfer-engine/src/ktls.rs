//! Kernel TLS: the kernel seals the records of a data channel whose handshake rustls did,
//! so that `sendfile` still sends from the page cache instead of through user space.
//!
//! The sequence is Linux's: attach the `tls` upper-layer protocol to the socket
//! (`TCP_ULP`; a kernel without the `tls` module refuses with `ENOENT`, and the stream
//! stays with rustls), then hand it the traffic keys, IVs and record sequence numbers
//! rustls negotiated, per direction (`TLS_TX`, `TLS_RX`). Only the sending side of a data
//! channel moves its records to the kernel: the receiver reads into pool buffers either
//! way, and it is the sender's `sendfile` that user-space TLS would turn into a copy. The
//! end of the stream is a `close_notify` alert, sent as a record of type 21 through a
//! control message.
//!
//! The layouts below are the kernel's UAPI (`linux/tls.h`); the tests check their sizes
//! and the key schedule's split into salt and explicit IV, which is all that can be
//! checked on a kernel without the module.

use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;

use rustls::ConnectionTrafficSecrets;

const SOL_TCP: libc::c_int = 6;
const TCP_ULP: libc::c_int = 31;
const SOL_TLS: libc::c_int = 282;
const TLS_TX: libc::c_int = 1;
const TLS_RX: libc::c_int = 2;
const TLS_SET_RECORD_TYPE: libc::c_int = 1;
const TLS_1_3_VERSION: u16 = 0x0304;
const TLS_CIPHER_AES_GCM_128: u16 = 51;
const TLS_CIPHER_AES_GCM_256: u16 = 52;
const TLS_CIPHER_CHACHA20_POLY1305: u16 = 54;
const ALERT_RECORD: u8 = 21;

#[repr(C)]
#[derive(Clone, Copy)]
struct CryptoInfo {
    version: u16,
    cipher_type: u16,
}

#[repr(C)]
struct AesGcm128 {
    info: CryptoInfo,
    iv: [u8; 8],
    key: [u8; 16],
    salt: [u8; 4],
    rec_seq: [u8; 8],
}

#[repr(C)]
struct AesGcm256 {
    info: CryptoInfo,
    iv: [u8; 8],
    key: [u8; 32],
    salt: [u8; 4],
    rec_seq: [u8; 8],
}

#[repr(C)]
struct Chacha20Poly1305 {
    info: CryptoInfo,
    iv: [u8; 12],
    key: [u8; 32],
    rec_seq: [u8; 8],
}

const _: () = assert!(std::mem::size_of::<AesGcm128>() == 40);
const _: () = assert!(std::mem::size_of::<AesGcm256>() == 56);
const _: () = assert!(std::mem::size_of::<Chacha20Poly1305>() == 56);

/// The bytes of one direction's `setsockopt(SOL_TLS, TLS_TX/TLS_RX)` argument.
fn crypto_info(sequence: u64, secrets: &ConnectionTrafficSecrets) -> io::Result<Vec<u8>> {
    let rec_seq = sequence.to_be_bytes();
    fn bytes<T>(value: &T) -> Vec<u8> {
        // SAFETY: the structs are `repr(C)` of byte arrays and u16s with no padding
        // (their sizes are asserted above), so every byte is initialized.
        unsafe {
            std::slice::from_raw_parts((value as *const T).cast::<u8>(), std::mem::size_of::<T>())
                .to_vec()
        }
    }
    let split = |iv: &[u8]| -> io::Result<([u8; 4], [u8; 8])> {
        // TLS 1.3's 12-byte IV: the kernel takes its first 4 bytes as the salt and the
        // rest as the explicit part, and XORs in the sequence number itself.
        let salt = iv[..4].try_into().map_err(|_| bad_secret())?;
        let rest = iv[4..12].try_into().map_err(|_| bad_secret())?;
        Ok((salt, rest))
    };
    Ok(match secrets {
        ConnectionTrafficSecrets::Aes128Gcm { key, iv } => {
            let (salt, iv) = split(iv.as_ref())?;
            bytes(&AesGcm128 {
                info: CryptoInfo {
                    version: TLS_1_3_VERSION,
                    cipher_type: TLS_CIPHER_AES_GCM_128,
                },
                iv,
                key: key.as_ref().try_into().map_err(|_| bad_secret())?,
                salt,
                rec_seq,
            })
        }
        ConnectionTrafficSecrets::Aes256Gcm { key, iv } => {
            let (salt, iv) = split(iv.as_ref())?;
            bytes(&AesGcm256 {
                info: CryptoInfo {
                    version: TLS_1_3_VERSION,
                    cipher_type: TLS_CIPHER_AES_GCM_256,
                },
                iv,
                key: key.as_ref().try_into().map_err(|_| bad_secret())?,
                salt,
                rec_seq,
            })
        }
        ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => bytes(&Chacha20Poly1305 {
            info: CryptoInfo {
                version: TLS_1_3_VERSION,
                cipher_type: TLS_CIPHER_CHACHA20_POLY1305,
            },
            iv: iv.as_ref().try_into().map_err(|_| bad_secret())?,
            key: key.as_ref().try_into().map_err(|_| bad_secret())?,
            rec_seq,
        }),
        _ => {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "a cipher the kernel does not take",
            ))
        }
    })
}

fn bad_secret() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        "a secret of an unexpected length",
    )
}

fn setsockopt(
    tcp: &TcpStream,
    level: libc::c_int,
    name: libc::c_int,
    value: &[u8],
) -> io::Result<()> {
    // SAFETY: a valid socket descriptor, and a pointer and length that describe `value`,
    // which the kernel only reads during the call.
    let rc = unsafe {
        libc::setsockopt(
            tcp.as_raw_fd(),
            level,
            name,
            value.as_ptr().cast(),
            value.len() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Attaches the kernel's TLS layer to the socket; fails (`ENOENT`) where the kernel has
/// no `tls` module, leaving the socket as it was.
pub fn attach_ulp(tcp: &TcpStream) -> io::Result<()> {
    setsockopt(tcp, SOL_TCP, TCP_ULP, b"tls")
}

/// Hands rustls's traffic secrets to the kernel, both directions. The connection is
/// consumed: from here on the socket carries plaintext as this process sees it.
pub fn enable(tcp: &TcpStream, conn: rustls::Connection) -> io::Result<()> {
    let secrets = conn
        .dangerous_extract_secrets()
        .map_err(|e| io::Error::other(format!("extracting the TLS secrets: {e}")))?;
    setsockopt(
        tcp,
        SOL_TLS,
        TLS_TX,
        &crypto_info(secrets.tx.0, &secrets.tx.1)?,
    )?;
    setsockopt(
        tcp,
        SOL_TLS,
        TLS_RX,
        &crypto_info(secrets.rx.0, &secrets.rx.1)?,
    )
}

/// Sends `close_notify` as an alert record through the kernel's TLS layer.
pub fn send_close_notify(tcp: &TcpStream) -> io::Result<()> {
    let alert = [1u8, 0u8]; // level warning, description close_notify
    let space = {
        // SAFETY: CMSG_SPACE only computes a size.
        unsafe { libc::CMSG_SPACE(1) as usize }
    };
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: alert.as_ptr() as *mut libc::c_void,
        iov_len: alert.len(),
    };
    // SAFETY: a zeroed msghdr is valid; it then points at `iov` and `control`, which live
    // until after the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg_control` holds room for one header with one byte of data
    // (CMSG_SPACE(1)), so the first header pointer and its data pointer are in bounds.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = SOL_TLS;
        (*cmsg).cmsg_type = TLS_SET_RECORD_TYPE;
        (*cmsg).cmsg_len = libc::CMSG_LEN(1) as _;
        *libc::CMSG_DATA(cmsg) = ALERT_RECORD;
    }
    // SAFETY: a valid socket and a message whose buffers outlive the call.
    let rc = unsafe { libc::sendmsg(tcp.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::crypto::cipher::{AeadKey, Iv};

    /// The argument the kernel gets: version, cipher, the IV split into the salt (its
    /// first 4 bytes) and the explicit part, the key, and the sequence number big-endian.
    #[test]
    fn crypto_info_lays_out_keys_as_the_kernel_reads_them() {
        let iv: [u8; 12] = core::array::from_fn(|i| i as u8);
        let key: [u8; 32] = core::array::from_fn(|i| 0xA0 ^ i as u8);
        let secrets = ConnectionTrafficSecrets::Aes256Gcm {
            key: AeadKey::from(key),
            iv: Iv::from(iv),
        };
        let info = crypto_info(0x0102_0304_0506_0708, &secrets).unwrap();
        assert_eq!(info.len(), 56);
        assert_eq!(&info[0..2], &0x0304u16.to_ne_bytes());
        assert_eq!(&info[2..4], &52u16.to_ne_bytes());
        assert_eq!(&info[4..12], &iv[4..12], "explicit IV");
        assert_eq!(&info[12..44], &key, "key");
        assert_eq!(&info[44..48], &iv[..4], "salt");
        assert_eq!(&info[48..56], &[1, 2, 3, 4, 5, 6, 7, 8], "record sequence");
        let chacha = ConnectionTrafficSecrets::Chacha20Poly1305 {
            key: AeadKey::from(key),
            iv: Iv::from(iv),
        };
        let info = crypto_info(1, &chacha).unwrap();
        assert_eq!(&info[2..4], &54u16.to_ne_bytes());
        assert_eq!(&info[4..16], &iv, "the whole IV, no salt");
        assert_eq!(&info[48..56], &[0, 0, 0, 0, 0, 0, 0, 1]);
    }

    /// This is the fallback's trigger: where the kernel has no `tls` module, attaching
    /// fails and the socket goes on working unchanged. (Where it has one, attaching
    /// succeeds; this checks only that the call is well formed either way.)
    #[test]
    fn attaching_reports_a_kernel_without_tls_and_leaves_the_socket_usable() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut b, _) = listener.accept().unwrap();
        match attach_ulp(&a) {
            Ok(()) => eprintln!("this kernel offers TLS"),
            Err(e) => {
                assert!(
                    matches!(
                        e.raw_os_error(),
                        Some(libc::ENOENT) | Some(libc::EOPNOTSUPP)
                    ),
                    "{e}"
                );
                a.write_all(b"still plain").unwrap();
                let mut got = [0u8; 11];
                b.read_exact(&mut got).unwrap();
                assert_eq!(&got, b"still plain");
            }
        }
    }
}
