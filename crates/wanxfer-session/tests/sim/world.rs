//! What a transfer moves and where it lands: the seeded source tree, the receiver's disk
//! (final names, named temporaries, the journal's bytes) with what a crash keeps of it,
//! and the knobs of one seed (session parameters and how hostile the world is).
//!
//! Nothing here is the code under test. The disk is a model of what the engine's sink,
//! committer and journal file do to a real one, written from `sink.rs`, `commit.rs` and
//! `state.rs`: what is durable when, and what a crash may or may not have kept. The
//! journal's records are the crate's own (`journal::Record`, `journal::replay`), so the
//! format and its replay are exercised as the engine uses them.

use std::collections::BTreeMap;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wanxfer_proto::Compare;

use super::content::{Label, Runs};

pub type Mtime = (i64, u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    /// A FIFO or device: the sender skips it and says so.
    Special,
}

/// One entry of the source tree, in walk order.
#[derive(Debug, Clone)]
pub struct SrcEntry {
    pub path: String,
    pub kind: Kind,
    pub size: u64,
    pub mtime: Mtime,
    pub label: Label,
    pub target: Vec<u8>,
    /// Earlier versions `(size, mtime, label)`, which a file may be put back to.
    pub history: Vec<(u64, Mtime, Label)>,
}

/// How often the world breaks things during one session.
#[derive(Debug, Clone, Default)]
pub struct Weather {
    /// Mean life of a data channel, if channels die at all.
    pub channel_life: Option<Duration>,
    pub cut_control: f64,
    pub crash_sender: f64,
    pub crash_receiver: f64,
    /// Per read job: the reader fails (the file vanished, an I/O error).
    pub read_fail: f64,
    /// Per block placed: the write fails (the file alone fails).
    pub write_fail: f64,
    /// Per entry applied: it cannot be placed here (it fails alone).
    pub apply_fail: f64,
    /// Per data connection opened: it is refused or fails to join.
    pub join_fail: f64,
}

/// One seed's transfer: parameters both sides agreed on and the model's own knobs.
#[derive(Debug, Clone)]
pub struct Config {
    pub block_size: u64,
    pub window: u32,
    pub status_every: u64,
    pub stall_timeout: Duration,
    pub streams: u16,
    pub max_streams: u16,
    pub readers: usize,
    /// The client sends (a push); otherwise it receives (a pull).
    pub push: bool,
    pub compare: Compare,
    pub checkpoint_bytes: u64,
    /// Control messages one side may have on the wire before its writer is full.
    pub writer_capacity: usize,
    pub latency: (Duration, Duration),
    /// Time a data channel takes to put one block on the wire.
    pub block_time: (Duration, Duration),
    /// A channel that takes this many times as long (a connection that left its
    /// start-up slow), if any: what the sender's hold-back and cut rules are for.
    pub slow_channel: Option<(u16, u32)>,
    /// How long a writer thread may hold a received block before placing it.
    pub place_delay: Duration,
    /// Chance that a side's loop takes several events before polling its machine.
    pub batch: f64,
    pub weather: Weather,
    /// Chance that the source changes between two sessions.
    pub change: f64,
    /// Sessions from which nothing but channel deaths happens: the transfer must then
    /// converge.
    pub calm_after: u32,
    pub max_sessions: u32,
}

impl Config {
    pub fn generate(rng: &mut ChaCha8Rng) -> Config {
        let ms = Duration::from_millis;
        let block_size = [64, 100, 256, 1000, 4096][rng.random_range(0..5)];
        let streams = rng.random_range(1..=4);
        // Drawn aside, so that every other knob of a seed is what it was before.
        let mut aside = ChaCha8Rng::from_seed(rng.get_seed());
        aside.set_stream(1);
        let slow_channel = aside
            .random_bool(0.3)
            .then(|| (aside.random_range(0..streams), aside.random_range(4..=40)));
        let latency_max = ms(*[2, 20, 80, 400].get(rng.random_range(0..4)).unwrap_or(&20));
        let hostile = rng.random_bool(0.75);
        let weather = if hostile {
            Weather {
                // Long enough, against the latency, that a channel delivers something
                // before it dies: a network that never does is not one to converge on.
                channel_life: rng
                    .random_bool(0.6)
                    .then(|| latency_max * rng.random_range(4..40) + ms(rng.random_range(5..400))),
                cut_control: pick(rng, &[0.0, 0.1, 0.3]),
                crash_sender: pick(rng, &[0.0, 0.15, 0.3]),
                crash_receiver: pick(rng, &[0.0, 0.2, 0.4]),
                read_fail: pick(rng, &[0.0, 0.0, 0.02, 0.1]),
                write_fail: pick(rng, &[0.0, 0.0, 0.005, 0.02]),
                apply_fail: pick(rng, &[0.0, 0.0, 0.01, 0.05]),
                join_fail: pick(rng, &[0.0, 0.1, 0.4]),
            }
        } else {
            Weather::default()
        };
        Config {
            block_size,
            window: [1, 2, 3, 8, 32, 256][rng.random_range(0..6)],
            status_every: rng.random_range(1..=8),
            stall_timeout: Duration::from_secs(10),
            streams,
            max_streams: streams + rng.random_range(0..=2),
            readers: rng.random_range(1..=3),
            push: rng.random_bool(0.5),
            compare: match rng.random_range(0..10) {
                0 => Compare::Always,
                1..=3 => Compare::Checksum,
                _ => Compare::QuickCheck,
            },
            checkpoint_bytes: block_size * rng.random_range(1..=4),
            writer_capacity: [1, 3, 16, 1000][rng.random_range(0..4)],
            latency: (ms(rng.random_range(0..2)), latency_max),
            block_time: (Duration::from_micros(50), ms(rng.random_range(1..4))),
            slow_channel,
            place_delay: ms(rng.random_range(0..30)),
            batch: pick(rng, &[0.0, 0.3, 0.8]),
            weather,
            change: pick(rng, &[0.0, 0.3, 0.7]),
            calm_after: rng.random_range(1..=6),
            max_sessions: 12,
        }
    }
}

fn pick(rng: &mut ChaCha8Rng, choices: &[f64]) -> f64 {
    choices[rng.random_range(0..choices.len())]
}

/// A name on the receiver's disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    Dir,
    File { size: u64, mtime: Mtime, data: Runs },
    Symlink { target: Vec<u8> },
}

/// A named temporary: what was written to it, split by whether a sync made it durable.
#[derive(Debug, Clone, Default)]
pub struct Temp {
    pub durable: Runs,
    pub volatile: Runs,
}

impl Temp {
    pub fn content(&self) -> Runs {
        let mut all = self.durable.clone();
        all.overlay(&self.volatile);
        all
    }

    pub fn write(&mut self, start: u64, end: u64, label: Label) {
        self.volatile.write(start, end, label);
    }

    fn sync(&mut self) {
        let volatile = std::mem::take(&mut self.volatile);
        self.durable.overlay(&volatile);
    }
}

/// A rename (or link) not yet made durable, with what it replaced.
#[derive(Debug)]
struct Undo {
    dest: String,
    before: Option<Node>,
    temp: Option<Temp>,
}

/// The receiver's disk.
#[derive(Debug, Default)]
pub struct Disk {
    pub names: BTreeMap<String, Node>,
    /// Named temporaries, by the destination they are for.
    pub temps: BTreeMap<String, Temp>,
    undo: Vec<Undo>,
    pub journal: Vec<u8>,
    pub journal_synced: usize,
}

impl Disk {
    /// `syncfs`: every temporary's data durable.
    pub fn sync_data(&mut self) {
        self.temps.values_mut().for_each(Temp::sync);
    }

    /// One temporary's data durable (`fdatasync`).
    pub fn sync_temp(&mut self, dest: &str) {
        if let Some(temp) = self.temps.get_mut(dest) {
            temp.sync();
        }
    }

    /// Puts `node` under `dest` (a rename from the named temporary, if there is one);
    /// durable only at the next [`Disk::sync_names`].
    pub fn rename(&mut self, dest: &str, node: Node) {
        let before = self.names.insert(dest.to_string(), node);
        let temp = self.temps.remove(dest);
        self.undo.push(Undo {
            dest: dest.to_string(),
            before,
            temp,
        });
    }

    pub fn sync_names(&mut self) {
        self.undo.clear();
    }

    pub fn append(&mut self, records: &[wanxfer_session::journal::Record]) {
        for r in records {
            r.encode(&mut self.journal);
        }
    }

    pub fn sync_journal(&mut self) {
        self.journal_synced = self.journal.len();
    }

    /// The power goes: what was not made durable may or may not be there.
    pub fn crash(&mut self, rng: &mut ChaCha8Rng) {
        for temp in self.temps.values_mut() {
            let volatile = std::mem::take(&mut temp.volatile);
            for (s, e, l) in volatile.runs() {
                if rng.random_bool(0.5) {
                    temp.durable.write(s, e, l);
                }
            }
        }
        while let Some(undo) = self.undo.pop() {
            if rng.random_bool(0.5) {
                continue; // the rename reached the disk
            }
            match undo.before {
                Some(node) => self.names.insert(undo.dest.clone(), node),
                None => self.names.remove(&undo.dest),
            };
            if let Some(temp) = undo.temp {
                self.temps.insert(undo.dest, temp);
            }
        }
        let unsynced = self.journal.len() - self.journal_synced;
        let kept = self.journal_synced + rng.random_range(0..=unsynced);
        self.journal.truncate(kept);
        self.journal_synced = kept;
    }
}
