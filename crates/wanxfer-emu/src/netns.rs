//! The two hosts: a network namespace each, joined only through a TUN device whose other
//! end is a file descriptor in the emulator. The devices are created in the emulator's
//! namespace and moved; their descriptors stay attached, and the devices vanish when the
//! descriptors close, so a crash cannot leave a half-connected link behind.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::Error;

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TUN: libc::c_short = 0x0001;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
/// Checksum offload and TSO for IPv4: the stack hands over (and takes) 64 KB batches.
const TUN_F_CSUM: libc::c_ulong = 0x01;
const TUN_F_TSO4: libc::c_ulong = 0x02;

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// One end of the emulated path.
#[derive(Debug)]
pub struct Host {
    pub netns: String,
    pub device: String,
    pub tun: File,
}

/// Runs `ip ARGS` and turns a failure into an error that shows the command.
pub fn ip(args: &[&str]) -> Result<(), Error> {
    run(Command::new("ip").args(args))
}

fn run(cmd: &mut Command) -> Result<(), Error> {
    let shown = format!("{cmd:?}");
    let out = cmd.output().map_err(|e| Error::Setup {
        what: shown.clone(),
        detail: e.to_string(),
    })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::Setup {
            what: shown,
            detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Names unique to this process and instance, short enough for interface names.
pub fn unique_prefix() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("wx{}x{n}", std::process::id() % 1_000_000)
}

/// Opens a TUN device named `name` in non-blocking mode, every packet preceded by a
/// virtio-net header, with checksum offload and IPv4 TSO (see the crate docs for why).
fn open_tun(name: &str) -> Result<File, Error> {
    let path = c"/dev/net/tun";
    // SAFETY: a valid NUL-terminated path and flags.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(Error::Setup {
            what: "open /dev/net/tun".into(),
            detail: std::io::Error::last_os_error().to_string(),
        });
    }
    // SAFETY: `fd` is a fresh descriptor we own.
    let file = unsafe { File::from_raw_fd(fd) };
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: IFF_TUN | IFF_NO_PI | IFF_VNET_HDR,
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads (and may write) an ifreq, which `req` is laid out as.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req) };
    if rc < 0 {
        return Err(Error::Setup {
            what: format!("TUNSETIFF {name}"),
            detail: std::io::Error::last_os_error().to_string(),
        });
    }
    // SAFETY: TUNSETOFFLOAD takes its flags by value.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4) };
    if rc < 0 {
        return Err(Error::Setup {
            what: format!("TUNSETOFFLOAD {name}"),
            detail: std::io::Error::last_os_error().to_string(),
        });
    }
    Ok(file)
}

/// Creates the namespace `netns` holding a TUN device with `address`, pointing at `peer`.
pub fn host(
    netns: &str,
    device: &str,
    address: &str,
    peer: &str,
    tcp_mem: u64,
) -> Result<Host, Error> {
    ip(&["netns", "add", netns])?;
    let tun = open_tun(device)?;
    ip(&["link", "set", "dev", device, "netns", netns])?;
    ip(&["-n", netns, "link", "set", "lo", "up"])?;
    ip(&[
        "-n", netns, "addr", "add", address, "peer", peer, "dev", device,
    ])?;
    // A long transmit queue: the emulator must not lose packets before it sees them.
    ip(&[
        "-n",
        netns,
        "link",
        "set",
        device,
        "mtu",
        "1500",
        "txqueuelen",
        "20000",
        "up",
    ])?;
    let mem = format!("4096 131072 {tcp_mem}");
    for (key, value) in [
        ("net.ipv4.tcp_rmem", mem.as_str()),
        ("net.ipv4.tcp_wmem", mem.as_str()),
        ("net.ipv4.tcp_no_metrics_save", "1"),
    ] {
        run(Command::new("ip")
            .args(["netns", "exec", netns, "sysctl", "-q", "-w"])
            .arg(format!("{key}={value}")))?;
    }
    Ok(Host {
        netns: netns.to_string(),
        device: device.to_string(),
        tun,
    })
}

/// Removes a namespace (killing nothing: the caller ends its own processes first).
pub fn remove(netns: &str) {
    let _ = ip(&["netns", "del", netns]);
}

/// Packets the kernel dropped in front of the emulator (its TUN queue overflowed): a
/// non-zero count makes a measurement invalid.
pub fn tx_dropped(host: &Host) -> Option<u64> {
    let out = Command::new("ip")
        .args(["netns", "exec", &host.netns, "cat"])
        .arg(format!(
            "/sys/class/net/{}/statistics/tx_dropped",
            host.device
        ))
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}
