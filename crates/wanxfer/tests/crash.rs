//! The crash matrix: SIGKILL the client or the server at seeded points of a push and of
//! a pull of a mixed tree (one large file among many small ones), then let the transfer
//! finish: the same command run again after the client died, the client's own retries
//! after the server died and was restarted. Each time the final tree must equal the source
//! byte for byte with modes and mtimes, no temporary or journal may be left on either
//! side, a re-run must send exactly what it did not find, and some run must resume
//! inside the large file. What was sent twice is printed for each case (`--nocapture`).
//!
//! Kill points are chosen without timing: a seed picks either a number of files that
//! must have reached their final names, or the large file's temporary having appeared
//! plus a few milliseconds. The CI-sized tree is the default; `WANXFER_CRASH_FULL=1`
//! (used by `bench/crash_matrix.sh`) makes it one 4 GiB file and 5,000 small ones.

mod common;

use std::fs;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::Duration;

use common::*;

/// The mixed tree's shape.
struct Shape {
    large: u64,
    small: usize,
    cases: u64,
}

fn shape() -> Shape {
    if std::env::var_os("WANXFER_CRASH_FULL").is_some() {
        Shape {
            large: 4 << 30,
            small: 5000,
            cases: 10,
        }
    } else {
        Shape {
            large: 160 << 20,
            small: 1200,
            cases: 10,
        }
    }
}

/// splitmix64: the seeded choices.
fn mix(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Small files in twelve directories with assorted modes and mtimes, and the large file
/// in the middle of the walk. Returns the total bytes.
fn mixed_tree(at: &Path, shape: &Shape) -> u64 {
    fs::create_dir_all(at).unwrap();
    let mut total = 0;
    for d in 0..12 {
        let dir = at.join(format!("{}-{d:02}", if d < 6 { "a" } else { "z" }));
        fs::create_dir(&dir).unwrap();
        for f in (d..shape.small).step_by(12) {
            let len = 1 + mix(f as u64) % (16 << 10);
            let path = dir.join(format!("f{f:05}"));
            fs::write(&path, pattern_bytes(len as usize, f)).unwrap();
            set_mode(&path, [0o644, 0o600, 0o755, 0o640][f % 4]);
            set_mtime(
                &path,
                1_600_000_000 + f as i64,
                (f * 7919) as u32 % 1_000_000_000,
            );
            total += len;
        }
        set_mode(&dir, [0o755, 0o750, 0o711][d % 3]);
        set_mtime(&dir, 1_500_000_000 + d as i64, 0);
    }
    let large = at.join("m-large.bin");
    write_pattern(&large, shape.large, 77);
    set_mtime(&large, 1_650_000_000, 123_456_789);
    total + shape.large
}

/// Files under their final names beneath `root` (temporaries not counted).
fn landed(root: &Path) -> usize {
    let mut count = 0;
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            match entry.file_type() {
                Ok(t) if t.is_dir() => dirs.push(entry.path()),
                Ok(_)
                    if !entry
                        .file_name()
                        .as_encoded_bytes()
                        .starts_with(b".wanxfer-") =>
                {
                    count += 1
                }
                _ => {}
            }
        }
    }
    count
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Victim {
    Client,
    Server,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Direction {
    Push,
    Pull,
}

/// Where a case's kill lands, chosen by its seed.
#[derive(Debug)]
enum KillPoint {
    /// Once this many files have their final names.
    Files(usize),
    /// This many milliseconds after the large file's temporary appears.
    InLarge(u64),
}

impl KillPoint {
    fn pick(seed: u64, shape: &Shape) -> KillPoint {
        let r = mix(seed);
        if r % 2 == 0 {
            KillPoint::Files(1 + (r >> 8) as usize % shape.small)
        } else {
            KillPoint::InLarge((r >> 8) % 150)
        }
    }

    /// Waits for the point; false if the transfer ended first.
    fn wait(&self, dest: &Path, client: &mut Child) -> bool {
        let reached = |dest: &Path| match self {
            KillPoint::Files(n) => landed(dest) >= *n,
            KillPoint::InLarge(_) => temp_files(dest).iter().any(|t| t.contains(".wanxfer-")),
        };
        loop {
            if client.try_wait().unwrap().is_some() {
                return false;
            }
            if reached(dest) {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if let KillPoint::InLarge(ms) = self {
            std::thread::sleep(Duration::from_millis(*ms));
        }
        client.try_wait().unwrap().is_none()
    }
}

/// The figures of one case.
#[derive(Debug)]
struct Outcome {
    case: String,
    point: KillPoint,
    /// Files under their final names when the kill came (None: the transfer ended
    /// before the kill point).
    landed_at_kill: Option<usize>,
    /// Bytes that crossed the network more than once: both runs (or all attempts)
    /// together, minus the tree.
    resent: u64,
    /// Bytes the finishing run found already there (held partial ranges and files up to
    /// date), as its report counts them.
    held: u64,
}

/// "N bytes received first" / "N bytes sent first" from the server's log of the
/// interrupted session.
fn first_run_bytes(log: &str) -> Option<u64> {
    log.lines()
        .filter(|l| l.contains("first; partial files kept"))
        .filter_map(|l| l.rsplit(" (").next()?.split(' ').next()?.parse().ok())
        .next_back()
}

/// A site for one direction's cases: the tree, a server whose journals are kept apart
/// (so that the test can check none is left), and the client's own state directory.
struct Matrix {
    site: Site,
    state: tempfile::TempDir,
    src: std::path::PathBuf,
    total: u64,
}

impl Matrix {
    fn new(direction: Direction) -> Matrix {
        let state = tempfile::tempdir().unwrap();
        let server_state = state.path().join("server");
        let site = Site::with_serve_flags(&["--state-dir", server_state.to_str().unwrap()]);
        let src = match direction {
            Direction::Push => site.path("src"),
            Direction::Pull => site.root().join("src"),
        };
        let total = mixed_tree(&src, &shape());
        Matrix {
            site,
            state,
            src,
            total,
        }
    }

    fn cp(&self, args: &[std::ffi::OsString]) -> std::process::Command {
        let mut cmd = cp_command(args);
        cmd.env("WANXFER_STATE_DIR", self.state.path().join("client"));
        cmd
    }

    fn run_case(&mut self, direction: Direction, victim: Victim, seed: u64) -> Outcome {
        let point = KillPoint::pick(seed, &shape());
        let case = format!("{direction:?}-{victim:?}-{seed}").to_lowercase();
        let (dest, args): (_, Vec<std::ffi::OsString>) = match direction {
            Direction::Push => (
                self.site.root().join(&case),
                vec![
                    "--json".into(),
                    self.src.clone().into(),
                    self.site.server.url(&case),
                ],
            ),
            Direction::Pull => (
                self.site.path(&case),
                vec![
                    "--json".into(),
                    self.site.server.url("src"),
                    self.site.path(&case).into(),
                ],
            ),
        };
        let mut client = self
            .cp(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let hit = point.wait(&dest, &mut client);
        let landed_at_kill = hit.then(|| landed(&dest));
        let (resent, held) = match victim {
            Victim::Client => {
                client.kill().unwrap();
                let _ = client.wait();
                let first = if hit {
                    wait_for(
                        "the server to end the session",
                        Duration::from_secs(60),
                        || first_run_bytes(&self.site.server.log()).is_some(),
                    );
                    first_run_bytes(&self.site.server.log()).unwrap()
                } else {
                    self.total
                };
                let run = finish(
                    self.cp(&args)
                        .stdout(Stdio::piped())
                        .stderr(Stdio::piped())
                        .spawn()
                        .unwrap(),
                );
                let json = run.assert_ok().json();
                let (rerun, held) = (
                    json["bytes"].as_u64().unwrap(),
                    json["bytes_skipped"].as_u64().unwrap(),
                );
                // The re-run sends exactly what it did not find: nothing twice, nothing missed.
                assert_eq!(rerun + held, self.total, "{case}: {json}");
                ((first + rerun).saturating_sub(self.total), held)
            }
            Victim::Server => {
                if hit {
                    self.site.server.restart();
                }
                let run = finish(client);
                let json = run.assert_ok().json();
                let sent = json["bytes"].as_u64().unwrap();
                let skipped = json["bytes_skipped"].as_u64().unwrap();
                ((sent + skipped).saturating_sub(self.total), skipped)
            }
        };
        assert_same_tree(&self.src, &dest, true);
        let left: Vec<String> = [
            temp_files(self.site.root()),
            temp_files(self.site.dir.path()),
        ]
        .concat();
        assert!(left.is_empty(), "{case}: temporaries left: {left:?}");
        let journals: Vec<String> = ["client/journals", "server/journals"]
            .iter()
            .flat_map(|d| {
                fs::read_dir(self.state.path().join(d))
                    .into_iter()
                    .flatten()
            })
            .flatten()
            .map(|e| e.path().display().to_string())
            .collect();
        assert!(journals.is_empty(), "{case}: journals left: {journals:?}");
        fs::remove_dir_all(&dest).unwrap();
        Outcome {
            case,
            point,
            landed_at_kill,
            resent,
            held,
        }
    }
}

fn matrix(direction: Direction) {
    let shape = shape();
    let mut m = Matrix::new(direction);
    let small = m.total - shape.large;
    let mut outcomes = Vec::new();
    for victim in [Victim::Client, Victim::Server] {
        for seed in 0..shape.cases {
            outcomes.push(m.run_case(
                direction,
                victim,
                seed * 2 + (victim == Victim::Server) as u64,
            ));
        }
    }
    eprintln!(
        "{direction:?}: tree {} bytes ({} of them in {} small files)",
        m.total, small, shape.small
    );
    for o in &outcomes {
        eprintln!(
            "  {:<22} kill {:<14} landed {:>6} resent {:>11} held {:>11} bytes",
            o.case,
            format!("{:?}", o.point),
            o.landed_at_kill
                .map_or("done".to_string(), |n| n.to_string()),
            o.resent,
            o.held
        );
    }
    let hits = outcomes
        .iter()
        .filter(|o| o.landed_at_kill.is_some())
        .count();
    assert!(
        hits >= outcomes.len() / 2,
        "most kills came mid-transfer: {outcomes:#?}"
    );
    // What is sent again is what was in flight or not yet durable at the kill: on
    // loopback, where gigabytes a second arrive, that can be all of a small tree. What
    // must hold is that resuming happens at all, inside the large file too.
    assert!(
        outcomes.iter().any(|o| o.held > small),
        "no run resumed inside the large file: {outcomes:#?}"
    );
}

#[test]
fn killing_either_side_mid_push_then_finishing_gives_the_tree_exactly() {
    matrix(Direction::Push);
}

#[test]
fn killing_either_side_mid_pull_then_finishing_gives_the_tree_exactly() {
    matrix(Direction::Pull);
}
