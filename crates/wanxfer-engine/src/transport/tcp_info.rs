//! What the kernel knows about a TCP connection (`TCP_INFO`), and the per-socket knobs a
//! session turns while it runs: the pacing rate (`SO_MAX_PACING_RATE`) and the congestion
//! control (`TCP_CONGESTION`).
//!
//! Why the kernel's numbers rather than our own timestamps: the kernel measures every
//! acknowledged segment (smoothed and lowest RTT, retransmissions, the delivery rate of
//! its rate sampler), for free and without a probe message of ours queued behind megabytes
//! of blocks. The layout is the kernel's ABI (`struct tcp_info` in `linux/tcp.h`), to which
//! fields are only ever appended; the `libc` crate's copy stops before the fields we need,
//! so it is written out here and every field read is checked against the length the
//! kernel filled in. What this module does not do: decide anything (see
//! `wanxfer_session::tune`).

use std::os::fd::AsRawFd;
use std::time::Duration;

/// `struct tcp_info` up to `tcpi_snd_wnd` (Linux 5.4). Older kernels fill a prefix.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct RawTcpInfo {
    state: u8,
    ca_state: u8,
    retransmits: u8,
    probes: u8,
    backoff: u8,
    options: u8,
    wscale: u8,
    app_limited: u8,
    rto: u32,
    ato: u32,
    snd_mss: u32,
    rcv_mss: u32,
    unacked: u32,
    sacked: u32,
    lost: u32,
    retrans: u32,
    fackets: u32,
    last_data_sent: u32,
    last_ack_sent: u32,
    last_data_recv: u32,
    last_ack_recv: u32,
    pmtu: u32,
    rcv_ssthresh: u32,
    rtt: u32,
    rttvar: u32,
    snd_ssthresh: u32,
    snd_cwnd: u32,
    advmss: u32,
    reordering: u32,
    rcv_rtt: u32,
    rcv_space: u32,
    total_retrans: u32,
    pacing_rate: u64,
    max_pacing_rate: u64,
    bytes_acked: u64,
    bytes_received: u64,
    segs_out: u32,
    segs_in: u32,
    notsent_bytes: u32,
    min_rtt: u32,
    data_segs_in: u32,
    data_segs_out: u32,
    delivery_rate: u64,
    busy_time: u64,
    rwnd_limited: u64,
    sndbuf_limited: u64,
    delivered: u32,
    delivered_ce: u32,
    bytes_sent: u64,
    bytes_retrans: u64,
    dsack_dups: u32,
    reord_seen: u32,
    rcv_ooopack: u32,
    snd_wnd: u32,
}

/// One look at a connection, in our units. Rates the kernel does not know (an older
/// kernel, or a connection that has sent nothing) are 0.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TcpInfo {
    /// Smoothed round-trip time, from acknowledged segments this side sent.
    pub rtt: Duration,
    /// Lowest round-trip time seen on the connection.
    pub min_rtt: Duration,
    /// The receiver's estimate of the round trip (it sends no data to time).
    pub rcv_rtt: Duration,
    /// Congestion window, in segments.
    pub cwnd: u32,
    pub mss: u32,
    /// Segments sent, and sent again, over the connection's life.
    pub segments_out: u64,
    pub total_retransmits: u64,
    /// Segments the peer acknowledged or selectively acknowledged, retransmissions
    /// included (`tcpi_delivered`): what crossed the path, which a hole in the stream
    /// does not hold back as it holds back `bytes_acked`.
    pub delivered: u64,
    /// Payload bytes the peer acknowledged (sending), or received (receiving).
    pub bytes_acked: u64,
    pub bytes_received: u64,
    /// The kernel's latest delivery-rate sample and its pacing rate, bytes per second.
    pub delivery_rate: u64,
    pub pacing_rate: u64,
    /// Bytes written and not yet sent (0 where the kernel does not say).
    pub unsent_bytes: u32,
}

/// Reads `TCP_INFO` of `socket`.
pub fn sample(socket: &impl AsRawFd) -> std::io::Result<TcpInfo> {
    let mut raw = RawTcpInfo::default();
    let mut len = std::mem::size_of::<RawTcpInfo>() as libc::socklen_t;
    // SAFETY: `raw` is a plain-old-data struct of `len` bytes that the kernel writes at
    // most `len` bytes of; `len` is updated to what it wrote.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut raw as *mut RawTcpInfo).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let filled = len as usize;
    // A field counts only if the kernel wrote all of it.
    let has = |end: usize| filled >= end;
    let us = |v: u32| Duration::from_micros(u64::from(v));
    let offset_of_end = |offset: usize, size: usize| offset + size;
    Ok(TcpInfo {
        rtt: us(raw.rtt),
        min_rtt: if has(offset_of_end(std::mem::offset_of!(RawTcpInfo, min_rtt), 4)) {
            us(raw.min_rtt)
        } else {
            Duration::ZERO
        },
        rcv_rtt: us(raw.rcv_rtt),
        cwnd: raw.snd_cwnd,
        mss: raw.snd_mss,
        segments_out: if has(offset_of_end(std::mem::offset_of!(RawTcpInfo, segs_out), 4)) {
            u64::from(raw.segs_out)
        } else {
            0
        },
        total_retransmits: u64::from(raw.total_retrans),
        delivered: if has(offset_of_end(
            std::mem::offset_of!(RawTcpInfo, delivered),
            4,
        )) {
            u64::from(raw.delivered)
        } else {
            0
        },
        bytes_acked: if has(offset_of_end(
            std::mem::offset_of!(RawTcpInfo, bytes_acked),
            8,
        )) {
            raw.bytes_acked
        } else {
            0
        },
        bytes_received: if has(offset_of_end(
            std::mem::offset_of!(RawTcpInfo, bytes_received),
            8,
        )) {
            raw.bytes_received
        } else {
            0
        },
        delivery_rate: if has(offset_of_end(
            std::mem::offset_of!(RawTcpInfo, delivery_rate),
            8,
        )) {
            raw.delivery_rate
        } else {
            0
        },
        pacing_rate: if has(offset_of_end(
            std::mem::offset_of!(RawTcpInfo, pacing_rate),
            8,
        )) {
            raw.pacing_rate
        } else {
            0
        },
        unsent_bytes: if has(offset_of_end(
            std::mem::offset_of!(RawTcpInfo, notsent_bytes),
            4,
        )) {
            raw.notsent_bytes
        } else {
            0
        },
    })
}

/// Caps the rate the kernel sends `socket`'s data at (`None`: no cap). TCP paces itself
/// to this (since Linux 4.13 without the `fq` queueing discipline too), so a session's
/// rate holds without bursts that overrun a shallow buffer on the path.
pub fn set_max_pacing_rate(socket: &impl AsRawFd, bytes_per_s: Option<u64>) -> std::io::Result<()> {
    // ~0 is the kernel's "unlimited".
    let value: u64 = bytes_per_s.map_or(u64::MAX, |r| r.max(1));
    set_option(socket, libc::SOL_SOCKET, libc::SO_MAX_PACING_RATE, &value)
}

/// Sets `socket`'s congestion control algorithm by name (`cubic`, `bbr`, ...).
pub fn set_congestion(socket: &impl AsRawFd, name: &str) -> std::io::Result<()> {
    set_option(
        socket,
        libc::IPPROTO_TCP,
        libc::TCP_CONGESTION,
        name.as_bytes(),
    )
}

/// Bounds the bytes `socket` keeps queued and not yet sent (`TCP_NOTSENT_LOWAT`): a
/// write waits while that many are, and the writer wakes when half of them left.
pub fn set_unsent_limit(socket: &impl AsRawFd, bytes: u32) -> std::io::Result<()> {
    let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    set_option(socket, libc::IPPROTO_TCP, libc::TCP_NOTSENT_LOWAT, &value)
}

/// One `setsockopt` with `value`'s bytes, of their own length (the kernel copies them).
fn set_option<T: ?Sized>(
    socket: &impl AsRawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: &T,
) -> std::io::Result<()> {
    // SAFETY: a pointer to `value` and its exact size; the kernel only reads them.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            name,
            (value as *const T).cast(),
            std::mem::size_of_val(value) as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The congestion control new sockets get unless told otherwise (`None` if unreadable).
pub fn default_congestion() -> Option<String> {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// The congestion control algorithms this kernel has loaded, as it lists them.
pub fn available_congestion() -> Vec<String> {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_congestion_control")
        .map(|s| s.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// Checks that this kernel lets a socket of ours use congestion control `name`, by
/// setting it on a fresh socket (the kernel may load its module for a privileged
/// process, so the list of loaded ones is not the whole answer). The error names the
/// algorithms available.
pub fn check_congestion(name: &str) -> Result<(), String> {
    // SAFETY: a plain socket() call; the descriptor is owned (and closed) at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(format!(
            "opening a socket to check --congestion {name}: {e}"
        ));
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    let socket = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    set_congestion(&socket, name).map_err(|e| {
        let available = available_congestion().join(", ");
        match e.raw_os_error() {
            Some(libc::ENOENT) => format!(
                "this kernel has no TCP congestion control `{name}` (available: {available}; \
                 a module such as tcp_{name} may need loading)"
            ),
            Some(libc::EPERM) => format!(
                "TCP congestion control `{name}` is not allowed for this user (see \
                 net.ipv4.tcp_allowed_congestion_control; available: {available})"
            ),
            _ => format!("setting TCP congestion control `{name}`: {e}"),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    /// The layout matches the kernel's up to `tcpi_snd_wnd` (offsets from `linux/tcp.h`).
    #[test]
    fn the_layout_is_the_kernels() {
        assert_eq!(std::mem::offset_of!(RawTcpInfo, rtt), 68);
        assert_eq!(std::mem::offset_of!(RawTcpInfo, total_retrans), 100);
        assert_eq!(std::mem::offset_of!(RawTcpInfo, pacing_rate), 104);
        assert_eq!(std::mem::offset_of!(RawTcpInfo, segs_out), 136);
        assert_eq!(std::mem::offset_of!(RawTcpInfo, min_rtt), 148);
        assert_eq!(std::mem::offset_of!(RawTcpInfo, delivery_rate), 160);
        assert_eq!(std::mem::offset_of!(RawTcpInfo, delivered), 192);
        assert_eq!(std::mem::offset_of!(RawTcpInfo, snd_wnd), 228);
    }

    /// Over loopback: what was sent is counted as acknowledged on one side and received
    /// on the other, and a pacing cap shows in the kernel's pacing rate until lifted.
    #[test]
    fn a_loopback_connection_reports_its_bytes_and_its_pacing_cap() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        set_max_pacing_rate(&client, Some(50_000_000)).unwrap();
        let data = vec![7u8; 1 << 20];
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; 1 << 20];
            server.read_exact(&mut got).unwrap();
            let info = sample(&server).unwrap();
            (got.len(), info, server)
        });
        client.write_all(&data).unwrap();
        let (len, server_info, mut server) = reader.join().unwrap();
        assert_eq!(len, 1 << 20);
        assert!(server_info.bytes_received >= 1 << 20, "{server_info:?}");
        // Acknowledgements may lag the last write by a moment.
        let mut info = sample(&client).unwrap();
        for _ in 0..100 {
            if info.bytes_acked >= 1 << 20 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
            info = sample(&client).unwrap();
        }
        assert!(info.bytes_acked >= 1 << 20, "{info:?}");
        assert!(info.segments_out > 0 && info.cwnd > 0, "{info:?}");
        // Every acknowledged byte crossed in a delivered segment of at most `mss`.
        assert!(
            info.delivered * u64::from(info.mss) >= info.bytes_acked,
            "{info:?}"
        );
        assert!(
            info.pacing_rate <= 50_000_000,
            "the cap holds the kernel's pacing rate: {info:?}"
        );
        // Lifted, the cap no longer holds the rate the kernel computes (what a
        // controller that stops pacing relies on).
        set_max_pacing_rate(&client, None).unwrap();
        let drain = std::thread::spawn(move || {
            let mut got = vec![0u8; 4 << 20];
            server.read_exact(&mut got).unwrap();
        });
        client.write_all(&vec![7u8; 4 << 20]).unwrap();
        drain.join().unwrap();
        let info = sample(&client).unwrap();
        assert!(
            info.pacing_rate > 50_000_000,
            "the lifted cap holds nothing: {info:?}"
        );
    }

    /// A name no kernel has is refused with the list of what it has.
    #[test]
    fn an_unknown_congestion_control_is_refused_by_name() {
        let err = check_congestion("no-such-cc").unwrap_err();
        assert!(err.contains("no-such-cc"), "{err}");
        assert!(check_congestion("reno").is_ok() || !available_congestion().is_empty());
    }

    /// A socket whose peer reads nothing takes writes until its unsent bytes reach the
    /// limit, where without one it takes what its send buffer holds.
    #[test]
    fn the_unsent_limit_bounds_what_a_socket_takes() {
        let held = |limit: Option<u32>| {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (_server, _) = listener.accept().unwrap();
            socket2::SockRef::from(&client)
                .set_send_buffer_size(8 << 20)
                .unwrap();
            if let Some(limit) = limit {
                set_unsent_limit(&client, limit).unwrap();
            }
            client.set_nonblocking(true).unwrap();
            let chunk = vec![1u8; 64 << 10];
            let mut written = 0usize;
            loop {
                match client.write(&chunk) {
                    Ok(n) => written += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => panic!("{e}"),
                }
                assert!(written < 64 << 20, "the socket took everything");
            }
            sample(&client).unwrap().unsent_bytes
        };
        let limited = held(Some(1 << 20));
        let unlimited = held(None);
        assert!(limited >= 1 << 19, "{limited}");
        assert!(limited <= (1 << 20) + (128 << 10), "{limited}");
        assert!(unlimited >= 4 << 20, "{unlimited}");
    }
}
