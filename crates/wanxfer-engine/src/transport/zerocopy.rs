//! `MSG_ZEROCOPY` sends of pool buffers (`--io zerocopy`).
//!
//! With `MSG_ZEROCOPY` the kernel pins the pages of a send and hands them to the NIC
//! instead of copying them into socket buffers; the buffer must then stay untouched until
//! the kernel says, on the socket's error queue, that it is done with it. So a channel
//! sending this way keeps each block until the notification covering its sends arrives,
//! and a block returns to the pool only then.
//!
//! It pays only where a device can send from user pages. On loopback (and through devices
//! without scatter-gather) the kernel copies anyway and flags every notification
//! `SO_EE_CODE_ZEROCOPY_COPIED`; the counters here make that visible in `--json`, which is
//! how `auto` was decided: on the machines this project is measured on every send was
//! copied, so `auto` keeps `sendfile` for file chunks and plain sends for pool buffers.
//!
//! There is a second reason, for long paths. TCP may have to retransmit from the pinned
//! pages, so the kernel releases them only once the peer has acknowledged the data: a
//! round trip after the send. What a stream has in flight is then bounded by the blocks
//! the pool can lend it, about `depth + 1`, as it is for the fabric transport's slots,
//! instead of by the socket buffer. Through the WAN emulator (40 ms, 1 Gbit/s, 512 MiB
//! memory to memory, 256 KiB blocks) `zerocopy` moved 0.23 Gbit/s against 0.83 for
//! `copy` while a channel held at most 4 blocks: 1 MiB per round trip, as predicted. So
//! a channel holds as many as the pool lends, and on a long path `--depth` must cover
//! the bandwidth-delay product in blocks.
//!
//! This module does not decide which blocks go this way; the TCP channel does.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::{Duration, Instant};

/// `SO_ZEROCOPY` from `asm-generic/socket.h` (not in the libc crate).
const SO_ZEROCOPY: libc::c_int = 60;
/// `SO_EE_ORIGIN_ZEROCOPY` from `linux/errqueue.h`.
const SO_EE_ORIGIN_ZEROCOPY: u8 = 5;
/// `SO_EE_CODE_ZEROCOPY_COPIED`: the kernel copied the data after all.
const SO_EE_CODE_ZEROCOPY_COPIED: u8 = 1;

/// How long the kernel may take to release a block before the channel gives up: a peer
/// that stops acknowledging holds our pages, and the stall timeout on the socket ends
/// the connection long before this.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(300);

/// Turns `MSG_ZEROCOPY` on for a socket.
pub fn enable(socket: BorrowedFd<'_>) -> io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: a valid socket descriptor and a pointer to an int of the size we pass.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_ZEROCOPY,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Sends that the kernel has not released yet, and what they keep alive.
///
/// Every successful `sendmsg(MSG_ZEROCOPY)` on a socket takes the next 32-bit sequence
/// number; a notification releases an inclusive range of them. Ranges normally come in
/// order, but nothing here relies on it.
#[derive(Debug)]
pub struct InFlight<T> {
    /// Sequence number the next send will take (as a 64-bit count, never wrapping).
    next: u64,
    /// Every send below this is released.
    released_below: u64,
    /// Released ranges that arrived ahead of an earlier unreleased send.
    ahead: Vec<(u64, u64)>,
    /// Items and the sequence number after their last send, oldest first.
    held: VecDeque<(u64, T)>,
    /// Sends whose notification said the kernel copied them.
    pub copied: u64,
    /// Sends made.
    pub sends: u64,
}

impl<T> Default for InFlight<T> {
    fn default() -> Self {
        InFlight {
            next: 0,
            released_below: 0,
            ahead: Vec::new(),
            held: VecDeque::new(),
            copied: 0,
            sends: 0,
        }
    }
}

impl<T> InFlight<T> {
    /// Counts one successful zero-copy send.
    pub fn sent(&mut self) {
        self.next += 1;
        self.sends += 1;
    }

    /// Keeps `item` until every send made so far is released.
    pub fn hold(&mut self, item: T) {
        if self.next > self.released_below {
            self.held.push_back((self.next, item));
        }
    }

    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Records the kernel's release of sends `lo..=hi` (its 32-bit numbers).
    pub fn release(&mut self, lo: u32, hi: u32, copied: bool) {
        // Place the 32-bit numbers next to the oldest unreleased send; there are never
        // anywhere near 2^31 sends outstanding.
        let base = self.released_below;
        let lo = base.wrapping_add(u64::from(lo.wrapping_sub(base as u32)));
        let count = u64::from(hi.wrapping_sub(lo as u32)) + 1;
        if lo + count > self.next {
            return; // not a range we sent: ignore rather than release live buffers
        }
        if copied {
            self.copied += count;
        }
        self.ahead.push((lo, lo + count));
        self.ahead.sort_unstable();
        while let Some(&(start, end)) = self.ahead.first() {
            if start > self.released_below {
                break;
            }
            self.released_below = self.released_below.max(end);
            self.ahead.remove(0);
        }
    }

    /// Items whose sends are all released, oldest first.
    pub fn take_released(&mut self) -> impl Iterator<Item = T> + '_ {
        let released_below = self.released_below;
        std::iter::from_fn(move || {
            if self.held.front()?.0 <= released_below {
                self.held.pop_front().map(|(_, item)| item)
            } else {
                None
            }
        })
    }
}

/// Reads every notification waiting on `socket`'s error queue into `flight`, waiting up
/// to `wait` for the first one when `wait` is not zero.
pub fn reap<T>(socket: BorrowedFd<'_>, flight: &mut InFlight<T>, wait: Duration) -> io::Result<()> {
    if !wait.is_zero() {
        let mut pfd = libc::pollfd {
            fd: socket.as_raw_fd(),
            events: 0, // POLLERR is always reported: it means the error queue has news
            revents: 0,
        };
        let ms = wait.as_millis().min(i32::MAX as u128) as libc::c_int;
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut pfd, 1, ms) } < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
    while let Some((lo, hi, copied)) = read_notification(socket)? {
        flight.release(lo, hi, copied);
    }
    Ok(())
}

/// Waits until at most `most` items are held.
pub fn wait_until_held_at_most<T>(
    socket: BorrowedFd<'_>,
    flight: &mut InFlight<T>,
    most: usize,
) -> io::Result<Vec<T>> {
    let deadline = Instant::now() + RELEASE_TIMEOUT;
    let mut released = Vec::new();
    loop {
        released.extend(flight.take_released());
        if flight.held() <= most {
            return Ok(released);
        }
        if Instant::now() > deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the kernel did not release zero-copy send buffers",
            ));
        }
        reap(socket, flight, Duration::from_millis(100))?;
    }
}

/// One zero-copy notification from the error queue, if one is waiting.
fn read_notification(socket: BorrowedFd<'_>) -> io::Result<Option<(u32, u32, bool)>> {
    // Room for one cmsg carrying a sock_extended_err and the offender address.
    let mut control = [0u64; 16];
    // SAFETY: a zeroed msghdr is valid; we point it at our control buffer only.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    loop {
        // SAFETY: msg points at a live control buffer of the size given; no data iovecs.
        let rc = unsafe {
            libc::recvmsg(
                socket.as_raw_fd(),
                &mut msg,
                libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT,
            )
        };
        if rc >= 0 {
            break;
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(e),
        }
    }
    // SAFETY: the kernel filled `msg` and its control buffer; CMSG_* walk within it.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            let (level, kind) = ((*cmsg).cmsg_level, (*cmsg).cmsg_type);
            let is_recverr = (level == libc::SOL_IP && kind == libc::IP_RECVERR)
                || (level == libc::SOL_IPV6 && kind == libc::IPV6_RECVERR);
            if is_recverr {
                let err = std::ptr::read_unaligned(
                    libc::CMSG_DATA(cmsg).cast::<libc::sock_extended_err>(),
                );
                if err.ee_origin == SO_EE_ORIGIN_ZEROCOPY && err.ee_errno == 0 {
                    let copied = err.ee_code & SO_EE_CODE_ZEROCOPY_COPIED != 0;
                    return Ok(Some((err.ee_info, err.ee_data, copied)));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    // Something else on the error queue: nothing for us, look again.
    read_notification(socket)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_released_only_when_all_its_sends_are() {
        let mut f = InFlight::default();
        f.sent();
        f.sent();
        f.hold("a"); // sends 0 and 1
        f.sent();
        f.hold("b"); // send 2
        f.release(0, 0, false);
        assert_eq!(f.take_released().count(), 0);
        f.release(1, 2, true);
        assert_eq!(f.take_released().collect::<Vec<_>>(), vec!["a", "b"]);
        assert_eq!((f.sends, f.copied), (3, 2));
    }

    #[test]
    fn ranges_out_of_order_release_once_the_gap_fills() {
        let mut f = InFlight::default();
        for item in 0..4 {
            f.sent();
            f.hold(item);
        }
        f.release(2, 3, false);
        assert_eq!(f.take_released().count(), 0);
        f.release(0, 1, false);
        assert_eq!(f.take_released().collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn sequence_numbers_wrap_at_32_bits() {
        let mut f = InFlight::default();
        f.next = u64::from(u32::MAX);
        f.released_below = f.next;
        f.sent();
        f.sent();
        f.hold(());
        f.release(u32::MAX, 0, false);
        assert_eq!(f.take_released().count(), 1);
    }

    #[test]
    fn a_range_we_never_sent_releases_nothing() {
        let mut f = InFlight::default();
        f.sent();
        f.hold(());
        f.release(5, 9, false);
        assert_eq!(f.take_released().count(), 0);
    }
}
