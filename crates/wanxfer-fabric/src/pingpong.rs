//! Ping-pong latency by message size (jin2005 §4.1, tian2011 Fig. 5): one message in
//! flight, answered by the peer, so each round trip shows the transport's per-message
//! cost. Both peers run in the calling process; used by `wanxfer bench --latency` and the
//! `pingpong` example.

use std::io::{IoSlice, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::Instant;

use crate::{
    Access, AlignedBuf, Channel, ChannelConfig, Credit, Event, FabricConfig, Listener, Result,
};

/// Message sizes measured by default: 8 B to 4 MiB.
pub const SIZES: [usize; 11] = [
    8,
    64,
    512,
    4 << 10,
    16 << 10,
    64 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One side of the fabric ping-pong: a one-slot pool granted to the peer, and a source
/// buffer written from.
struct Side {
    ch: Channel,
    src: AlignedBuf,
    credit: Option<Credit>,
}

impl Side {
    fn new(max: usize, mut ch: Channel) -> Result<Side> {
        let pool = ch.register(AlignedBuf::new(max), Access::REMOTE_WRITE)?;
        ch.set_slot_pool(pool, max)?;
        ch.grant(0)?;
        let mut src = AlignedBuf::new(max);
        src.as_mut_slice().fill(0x5a);
        // SAFETY: `src` lives in this struct for as long as the channel.
        unsafe { ch.register_raw(src.as_mut_ptr(), max, Access::WRITE_SOURCE)? };
        Ok(Side {
            ch,
            src,
            credit: None,
        })
    }

    fn send(&mut self, len: usize) -> Result<()> {
        while self.credit.is_none() {
            let event = self.ch.wait(None)?.expect("no timeout");
            self.take(event);
        }
        let credit = self.credit.take().expect("just checked");
        self.ch
            .write_block(&[IoSlice::new(&self.src.as_slice()[..len])], credit)
    }

    fn receive(&mut self) -> Result<()> {
        loop {
            match self.ch.wait(None)?.expect("no timeout") {
                Event::BlockArrived { slot, .. } => return self.ch.grant(slot),
                other => self.take(other),
            }
        }
    }

    fn take(&mut self, event: Event) {
        match event {
            Event::Credit(c) => self.credit = Some(c),
            Event::WriteComplete { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// Median one-way latency in seconds (half a round trip) for each size, over a block
/// channel on `provider` at `ip`: an RDMA write into the peer's granted slot, answered
/// the same way.
pub fn fabric_pingpong(
    provider: &str,
    ip: IpAddr,
    sizes: &[usize],
    iters: usize,
) -> Result<Vec<f64>> {
    let max = sizes.iter().copied().max().unwrap_or(8);
    let sizes_owned = sizes.to_vec();
    let cfg = ChannelConfig::default();
    let fabric = FabricConfig::with_provider(provider);
    let mut listener = Listener::bind(&fabric, SocketAddr::new(ip, 0))?;
    let addr = listener.local_addr();
    let echo_cfg = cfg.clone();
    let echo = thread::spawn(move || -> Result<()> {
        let mut side = Side::new(max, Channel::accept(&mut listener, &echo_cfg)?)?;
        for &len in &sizes_owned {
            for _ in 0..iters + 1 {
                side.receive()?;
                side.send(len)?;
            }
        }
        side.ch.close(None).map(drop)
    });
    let mut side = Side::new(max, Channel::connect(&fabric, addr, &cfg)?)?;
    let mut out = Vec::new();
    for &len in sizes {
        let mut rtts = Vec::with_capacity(iters);
        for i in 0..iters + 1 {
            let start = Instant::now();
            side.send(len)?;
            side.receive()?;
            if i > 0 {
                rtts.push(start.elapsed().as_secs_f64());
            }
        }
        out.push(median(rtts) / 2.0);
    }
    side.ch.close(None)?;
    echo.join().expect("echo thread")?;
    Ok(out)
}

/// The same over a plain TCP connection (`TCP_NODELAY`), for comparison.
pub fn tcp_pingpong(ip: IpAddr, sizes: &[usize], iters: usize) -> std::io::Result<Vec<f64>> {
    let max = sizes.iter().copied().max().unwrap_or(8);
    let sizes_owned = sizes.to_vec();
    let listener = TcpListener::bind(SocketAddr::new(ip, 0))?;
    let addr = listener.local_addr()?;
    let echo = thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = vec![0u8; max];
        for &len in &sizes_owned {
            for _ in 0..iters + 1 {
                s.read_exact(&mut buf[..len])?;
                s.write_all(&buf[..len])?;
            }
        }
        Ok(())
    });
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let mut buf = vec![0x5au8; max];
    let mut out = Vec::new();
    for &len in sizes {
        let mut rtts = Vec::with_capacity(iters);
        for i in 0..iters + 1 {
            let start = Instant::now();
            s.write_all(&buf[..len])?;
            s.read_exact(&mut buf[..len])?;
            if i > 0 {
                rtts.push(start.elapsed().as_secs_f64());
            }
        }
        out.push(median(rtts) / 2.0);
    }
    echo.join().expect("echo thread")?;
    Ok(out)
}
