//! Shared end-to-end harness: a real `wanxfer serve` child on loopback, `wanxfer cp` runs
//! with their exit code and JSON, and tree builders and comparisons that look at names
//! byte for byte, contents, modes, mtimes and symlink targets.
//!
//! Every test gets its own server, root and secret, so tests run in parallel without
//! sharing state, and a server that dies is noticed by the test that killed it only.
//!
//! Every connection is TLS, as by default. The servers of one test process share one
//! certificate ([`test_identity`]): clients pin a server's fingerprint per `HOST:PORT`
//! in the process's state directory, and two servers that happen to get the same port
//! one after the other must not look like a server whose key was replaced. Tests of
//! certificate changes pass their own `--cert`/`--key`.
#![allow(dead_code)] // each test binary uses a different part of the harness

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::symlink;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const SECRET: &str = "e2e-test-secret-0123456789abcdef";

pub fn wanxfer_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_wanxfer"))
}

/// A `wanxfer serve` child on 127.0.0.1 with its own root, killed on drop.
pub struct Server {
    child: Option<Child>,
    pub addr: String,
    pub root: PathBuf,
    log: PathBuf,
    extra: Vec<String>,
}

impl Server {
    /// Serves `root` (which must exist) on loopback with [`SECRET`] and any extra `serve`
    /// flags.
    pub fn start(root: &Path, extra: &[&str]) -> Server {
        let mut cmd = Command::new(wanxfer_bin());
        cmd.args(["serve", "--listen", "127.0.0.1:0"]);
        Server::start_with(cmd, root, extra)
    }

    /// Serves `root` with `cmd` (a `wanxfer` invocation up to `serve --listen ADDR`, run
    /// where the caller wants, e.g. inside a network namespace).
    pub fn start_with(mut cmd: Command, root: &Path, extra: &[&str]) -> Server {
        if !extra.contains(&"--cert") {
            let (cert, key) = test_identity();
            cmd.arg("--cert").arg(cert).arg("--key").arg(key);
        }
        let log = root
            .parent()
            .expect("roots live in a temporary directory")
            .join(format!(
                "serve-{}.log",
                root.file_name().unwrap().to_string_lossy()
            ));
        let mut child = cmd
            .arg("--root")
            .arg(root)
            .args(extra)
            .env("WANXFER_SECRET", SECRET)
            .env("WANXFER_STATE_DIR", state_dir())
            .env(
                "RUST_LOG",
                std::env::var("WANXFER_TEST_SERVER_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdout(Stdio::piped())
            .stderr(fs::File::create(&log).expect("server log"))
            .spawn()
            .expect("start wanxfer serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("read the serving line");
        let addr = line
            .trim()
            .rsplit(" on ")
            .next()
            .filter(|a| a.parse::<std::net::SocketAddr>().is_ok())
            .unwrap_or_else(|| panic!("server did not start: {line:?}"))
            .to_string();
        Server {
            child: Some(child),
            addr,
            root: root.to_path_buf(),
            log,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// Starts the server again (after [`Server::kill`]) on the same address and root,
    /// with the same flags: what an operator's restart does.
    pub fn restart(&mut self) {
        self.kill();
        let mut cmd = Command::new(wanxfer_bin());
        cmd.args(["serve", "--listen", &self.addr]);
        let extra: Vec<&str> = self.extra.iter().map(String::as_str).collect();
        let mut again = Server::start_with(cmd, &self.root.clone(), &extra);
        self.child = again.child.take();
        self.log = again.log.clone();
    }

    /// `wanxfer://ADDR/PATH`.
    pub fn url(&self, path: &str) -> OsString {
        format!("wanxfer://{}/{}", self.addr, path).into()
    }

    /// `wanxfer://ADDR/` followed by raw path bytes.
    pub fn url_bytes(&self, path: &[u8]) -> OsString {
        let mut url = format!("wanxfer://{}/", self.addr).into_bytes();
        url.extend_from_slice(path);
        OsString::from_vec(url)
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("server running").id() as i32
    }

    /// Whether the server process is still alive (it must survive bad clients).
    pub fn is_running(&mut self) -> bool {
        let child = self.child.as_mut().expect("server running");
        child.try_wait().expect("wait on server").is_none()
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A finished `wanxfer cp`.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// Runs `cmd` to completion.
    pub fn from_cmd(mut cmd: Command) -> Run {
        Run::from_output(cmd.output().expect("run wanxfer"))
    }

    fn from_output(out: Output) -> Run {
        Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// The `--json` summary (the last line of stdout).
    pub fn json(&self) -> serde_json::Value {
        let line = self.stdout.lines().last().unwrap_or_default();
        serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {:?}", self.stdout))
    }

    /// Every line of stdout as JSON (`--json` output of ls, and of commands given
    /// several operands).
    pub fn json_lines(&self) -> Vec<serde_json::Value> {
        self.stdout
            .lines()
            .map(|line| {
                serde_json::from_str(line)
                    .unwrap_or_else(|e| panic!("not JSON ({e}): {line:?} in {self:#?}"))
            })
            .collect()
    }

    #[track_caller]
    pub fn assert_ok(&self) -> &Run {
        assert_eq!(self.code, 0, "wanxfer cp failed: {self:#?}");
        self
    }

    #[track_caller]
    pub fn assert_code(&self, code: i32) -> &Run {
        assert_eq!(self.code, code, "unexpected exit code: {self:#?}");
        self
    }

    #[track_caller]
    pub fn assert_stderr_mentions(&self, needle: &str) -> &Run {
        assert!(
            self.stderr.contains(needle),
            "stderr should mention {needle:?}: {self:#?}"
        );
        self
    }
}

/// Where this test process's clients and servers keep their state (journals,
/// placements, pinned certificates): apart from the user's own, and from other test
/// processes'.
pub fn state_dir() -> PathBuf {
    std::env::temp_dir().join(format!("wanxfer-test-state-{}", std::process::id()))
}

/// The certificate and key every server of this test process presents (created on
/// first use, as a server creates its own).
pub fn test_identity() -> (PathBuf, PathBuf) {
    static MADE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let dir = MADE.get_or_init(|| {
        let dir = state_dir().join("test-identity");
        wanxfer_engine::tls::ServerIdentity::load_or_create(&dir).expect("a test certificate");
        dir
    });
    (
        dir.join(wanxfer_engine::tls::CERT_FILE),
        dir.join(wanxfer_engine::tls::KEY_FILE),
    )
}

/// A `wanxfer cp` command with the test secret and no progress bar.
pub fn cp_command<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new(wanxfer_bin());
    cmd.arg("cp")
        .arg("--quiet")
        .args(args)
        .env("WANXFER_SECRET", SECRET)
        .env("WANXFER_STATE_DIR", state_dir())
        .env_remove("RUST_LOG");
    cmd
}

/// As [`cp_command`] without `--quiet`: warnings (a data channel lost, say) are printed.
pub fn cp_loud_command<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new(wanxfer_bin());
    cmd.arg("cp")
        .args(args)
        .env("WANXFER_SECRET", SECRET)
        .env("WANXFER_STATE_DIR", state_dir())
        .env_remove("RUST_LOG");
    cmd
}

/// `wanxfer cp` run by `cmd` (e.g. inside a network namespace), with the test secret.
pub fn cp_via<I, S>(mut cmd: Command, args: I) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    cmd.arg("cp")
        .arg("--quiet")
        .args(args)
        .env("WANXFER_SECRET", SECRET)
        .env("WANXFER_STATE_DIR", state_dir());
    Run::from_output(cmd.output().expect("run wanxfer cp"))
}

/// Runs `wanxfer cp ARGS...` to completion.
pub fn cp<I, S>(args: I) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    Run::from_output(cp_command(args).output().expect("run wanxfer cp"))
}

/// Runs `wanxfer cp ARGS...` without `--quiet`, so that its summary and notes are printed
/// (stderr is not a terminal, so there is no progress bar).
pub fn cp_with_notes<I, S>(args: I) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new(wanxfer_bin());
    cmd.arg("cp")
        .args(args)
        .env("WANXFER_SECRET", SECRET)
        .env("WANXFER_STATE_DIR", state_dir())
        .env_remove("RUST_LOG");
    Run::from_output(cmd.output().expect("run wanxfer cp"))
}

/// Runs `wanxfer cp ARGS...` with another secret.
pub fn cp_with_secret<I, S>(secret: &str, args: I) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = cp_command(args);
    cmd.env("WANXFER_SECRET", secret);
    Run::from_output(cmd.output().expect("run wanxfer cp"))
}

/// Runs `wanxfer SUBCOMMAND ARGS...` (a remote operation: ls, stat, sum, ...) to
/// completion with the test secret.
pub fn wanxfer<I, S>(subcommand: &str, args: I) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    wanxfer_with_secret(SECRET, subcommand, args)
}

/// Runs `wanxfer SUBCOMMAND ARGS...` with `secret` in WANXFER_SECRET.
pub fn wanxfer_with_secret<I, S>(secret: &str, subcommand: &str, args: I) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let out = Command::new(wanxfer_bin())
        .arg(subcommand)
        .args(args)
        .env("WANXFER_SECRET", secret)
        .env("WANXFER_STATE_DIR", state_dir())
        .env_remove("RUST_LOG")
        .output()
        .expect("run wanxfer");
    Run::from_output(out)
}

/// Starts `cmd` (a [`cp_command`], say) with its output captured for [`finish`].
pub fn spawn_piped(mut cmd: Command) -> Child {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start wanxfer")
}

/// A finished child started with [`cp_command`].
pub fn finish(child: Child) -> Run {
    Run::from_output(child.wait_with_output().expect("wait for wanxfer cp"))
}

/// One node of a tree as the tests see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    File {
        mode: u32,
        mtime: (i64, i64),
        digest: [u8; 32],
        size: u64,
    },
    Dir {
        mode: u32,
        mtime: (i64, i64),
    },
    Symlink {
        target: Vec<u8>,
    },
}

/// Every entry under `root` by relative path (bytes), without following symlinks.
/// Directory mtimes are left out when `dir_mtimes` is false.
pub fn snapshot(root: &Path) -> BTreeMap<Vec<u8>, Node> {
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<Vec<u8>, Node>) {
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())) {
        let path = entry.expect("directory entry").path();
        let rel = path
            .strip_prefix(root)
            .unwrap()
            .as_os_str()
            .as_bytes()
            .to_vec();
        let node = node(&path);
        if matches!(node, Node::Dir { .. }) {
            walk(root, &path, out);
        }
        out.insert(rel, node);
    }
}

/// One path as the tests see it (not followed if a symlink).
pub fn node(path: &Path) -> Node {
    let meta = fs::symlink_metadata(path).unwrap_or_else(|e| panic!("lstat {path:?}: {e}"));
    let mtime = (meta.mtime(), meta.mtime_nsec());
    let mode = meta.permissions().mode() & 0o7777;
    if meta.file_type().is_symlink() {
        Node::Symlink {
            target: fs::read_link(path).unwrap().into_os_string().into_vec(),
        }
    } else if meta.is_dir() {
        Node::Dir { mode, mtime }
    } else {
        Node::File {
            mode,
            mtime,
            digest: digest_file(path),
            size: meta.len(),
        }
    }
}

fn digest_file(path: &Path) -> [u8; 32] {
    use sha2::Digest;
    let mut file = fs::File::open(path).expect("open for digest");
    let mut hasher = sha2::Sha256::new();
    std::io::copy(&mut file, &mut hasher).expect("read for digest");
    hasher.finalize().into()
}

/// Asserts `copy` holds exactly what `original` holds: names, kinds, contents, modes,
/// file mtimes and symlink targets (directory mtimes too when `dir_mtimes`).
#[track_caller]
pub fn assert_same_tree(original: &Path, copy: &Path, dir_mtimes: bool) {
    let normalize = |mut tree: BTreeMap<Vec<u8>, Node>| {
        if !dir_mtimes {
            for node in tree.values_mut() {
                if let Node::Dir { mtime, .. } = node {
                    *mtime = (0, 0);
                }
            }
        }
        tree
    };
    let a = normalize(snapshot(original));
    let b = normalize(snapshot(copy));
    let only_a: Vec<_> = a.keys().filter(|k| !b.contains_key(*k)).collect();
    let only_b: Vec<_> = b.keys().filter(|k| !a.contains_key(*k)).collect();
    assert!(
        only_a.is_empty() && only_b.is_empty(),
        "trees differ: missing in copy {:?}, extra in copy {:?}",
        lossy(&only_a),
        lossy(&only_b)
    );
    for (path, node) in &a {
        assert_eq!(node, &b[path], "{} differs", String::from_utf8_lossy(path));
    }
}

fn lossy(paths: &[&Vec<u8>]) -> Vec<String> {
    paths
        .iter()
        .take(10)
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect()
}

/// Paths of entries anywhere under `root` whose final name is a wanxfer temporary file.
/// Names only: a temporary has its full size reserved from its first block, and tests
/// poll this while gigabytes are in flight, so contents are never read.
pub fn temp_files(root: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue; // removed while we looked
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                dirs.push(path.clone());
            }
            if entry.file_name().as_bytes().starts_with(b".wanxfer-") {
                found.push(path.display().to_string());
            }
        }
    }
    found
}

/// Writes `len` bytes of a seeded, incompressible-looking pattern.
pub fn write_pattern(path: &Path, len: u64, seed: u64) {
    let mut file = fs::File::create(path).expect("create pattern file");
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut buf = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        for chunk in buf.chunks_exact_mut(8) {
            // xorshift64*
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            chunk.copy_from_slice(&state.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
        }
        let n = left.min(buf.len() as u64) as usize;
        file.write_all(&buf[..n]).expect("write pattern");
        left -= n as u64;
    }
}

pub fn set_mode(path: &Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("chmod");
}

/// Sets a file's or directory's mtime (seconds and nanoseconds) without following links.
pub fn set_mtime(path: &Path, sec: i64, nsec: u32) {
    let file = fs::File::open(path).expect("open to set mtime");
    let time = std::time::UNIX_EPOCH + Duration::new(sec as u64, nsec);
    file.set_times(fs::FileTimes::new().set_modified(time).set_accessed(time))
        .expect("set mtime");
}

/// Waits until `cond` holds, polling; panics after `limit` with `what`.
pub fn wait_for(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A process's peak resident set (VmHWM), in KiB.
pub fn peak_rss_kib(pid: i32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/PID/status")
}

/// Bytes free for an unprivileged writer on the file system holding `path`.
pub fn free_bytes(path: &Path) -> u64 {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid C string and a zeroed statvfs the call fills in.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    assert_eq!(rc, 0, "statvfs {}", path.display());
    st.f_bavail as u64 * st.f_frsize as u64
}

/// Runs `cmd` (a [`cp_command`], say) to its end, within `limit` (else it is killed and
/// the test fails: a hang is a failure, not a wait), and returns how it ended with its
/// peak resident set in KiB, as the kernel counted it for the whole process.
pub fn run_measured(mut cmd: Command, limit: Duration) -> (Run, u64) {
    let out = tempfile::tempfile().expect("stdout file");
    let err = tempfile::tempfile().expect("stderr file");
    let child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(err.try_clone().unwrap())
        .spawn()
        .expect("start wanxfer");
    let pid = child.id() as libc::pid_t;
    let started = Instant::now();
    let mut status = 0;
    // SAFETY: zeroed rusage, filled in by wait4.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: our own child, valid out-pointers.
        let rc = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if rc == pid {
            break;
        }
        assert!(rc == 0, "wait4: {}", std::io::Error::last_os_error());
        if started.elapsed() > limit {
            signal(pid, "KILL");
            panic!("wanxfer {:?} did not end within {limit:?}", cmd.get_args());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(child); // reaped above
    let read = |mut f: fs::File| {
        use std::io::{Read, Seek};
        let mut text = String::new();
        f.rewind().unwrap();
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes).unwrap();
        text.push_str(&String::from_utf8_lossy(&bytes));
        text
    };
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        -1
    };
    let run = Run {
        code,
        stdout: read(out),
        stderr: read(err),
    };
    (run, usage.ru_maxrss as u64)
}

/// Waits for a child started with [`cp_command`] at most `limit`; past it the child is
/// killed and the test fails (a session that hangs is the failure being tested for).
pub fn finish_within(child: Child, limit: Duration) -> Run {
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let _ = tx.send(finish(child));
    });
    match rx.recv_timeout(limit) {
        Ok(run) => {
            let _ = waiter.join();
            run
        }
        Err(_) => {
            signal(pid, "KILL");
            let run = rx.recv().ok();
            panic!("wanxfer cp did not end within {limit:?}: {run:#?}");
        }
    }
}

/// Sends a signal to a process (SIGSTOP/SIGCONT/SIGKILL by number).
pub fn signal(pid: i32, sig: &str) {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{sig} {pid} failed");
}

pub fn is_root() -> bool {
    fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2))
                == Some("0")
        })
        .unwrap_or(false)
}

/// Whether libfabric's tcp provider is usable here; tests skip (saying so) if not.
pub fn fabric_available() -> bool {
    let ok = std::process::Command::new("fi_info")
        .args(["-p", "tcp", "-t", "FI_EP_MSG"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipped: libfabric's tcp provider is not available (fi_info -p tcp)");
    }
    ok
}

/// A temporary directory with a server root `root/` and a client area beside it.
///
/// Fields drop in this order: the server stops, then the root's file system (if the root
/// is a mount) is unmounted, then the directory goes.
pub struct Site {
    pub server: Server,
    pub mount: Option<Mount>,
    pub dir: tempfile::TempDir,
}

impl Site {
    pub fn new() -> Site {
        Site::with_serve_flags(&[])
    }

    pub fn with_serve_flags(flags: &[&str]) -> Site {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("root");
        fs::create_dir(&root).unwrap();
        let server = Server::start(&root, flags);
        Site {
            server,
            mount: None,
            dir,
        }
    }

    /// A site whose root is a file system of its own (a small tmpfs to fill, say); `None`
    /// (and a note) where mounting is not possible.
    pub fn on_mount(fstype: &str, options: &str, flags: &[&str]) -> Option<Site> {
        let dir = tempfile::tempdir().expect("tempdir");
        let mount = Mount::new(dir.path().join("root"), fstype, options)?;
        let server = Server::start(&mount.path, flags);
        Some(Site {
            server,
            mount: Some(mount),
            dir,
        })
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub fn root(&self) -> &Path {
        &self.server.root
    }
}

/// A tree with every kind of entry and name the issue lists.
pub fn odd_tree(at: &Path) {
    fs::create_dir_all(at).unwrap();
    let names: Vec<&[u8]> = vec![
        b"with space",
        b"new\nline",
        b"-leading-dash",
        b"--help",
        "Überdaten-数据-ε".as_bytes(),
        b"non-utf8-\xff\xfe",
        b"tab\there",
        b"back\\slash",
    ];
    for (i, name) in names.iter().enumerate() {
        let path = at.join(OsStr::from_bytes(name));
        write_pattern(&path, 1000 + i as u64 * 4097, i as u64);
    }
    let long = "n".repeat(255);
    write_pattern(&at.join(&long), 12345, 99);
    fs::create_dir(at.join("d".repeat(255))).unwrap();

    fs::File::create(at.join("empty")).unwrap();
    fs::create_dir_all(at.join("empty-dir")).unwrap();
    fs::create_dir_all(at.join("nested/empty-inner")).unwrap();

    let mut deep = at.join("deep");
    for level in 0..64 {
        deep.push(format!("level-{level}"));
    }
    fs::create_dir_all(&deep).unwrap();
    write_pattern(&deep.join("bottom.bin"), 70_000, 7);

    let private = at.join("private.key");
    write_pattern(&private, 3000, 3);
    set_mode(&private, 0o600);
    let script = at.join("run.sh");
    write_pattern(&script, 100, 4);
    set_mode(&script, 0o755);
    let ro = at.join("read-only");
    write_pattern(&ro, 5000, 5);
    set_mode(&ro, 0o444);
    fs::create_dir(at.join("restricted")).unwrap();
    write_pattern(&at.join("restricted/inside"), 10, 6);

    symlink("with space", at.join("link-to-file")).unwrap();
    symlink("/etc/passwd", at.join("absolute-link")).unwrap();
    symlink("../../outside/of/everything", at.join("dangling-escape")).unwrap();
    symlink("deep/level-0", at.join("link-to-dir")).unwrap();

    // Block-sized edges: a file exactly one block, one byte over, one byte under.
    for (name, len) in [
        ("block-exact", 1 << 20),
        ("block-plus", (1 << 20) + 1),
        ("block-minus", (1 << 20) - 1),
    ] {
        write_pattern(&at.join(name), len, len);
    }

    // mtimes (with nanoseconds) on files and directories, directories last since
    // writing into them moves their mtime.
    set_mtime(&at.join("private.key"), 1_000_000_000, 123_456_789);
    set_mtime(&at.join("empty"), 1_500_000_000, 1);
    set_mtime(&deep.join("bottom.bin"), 1_234_567_890, 0);
    set_mode(&at.join("restricted"), 0o750);
    set_mtime(&at.join("restricted"), 1_600_000_000, 500);
    set_mtime(&at.join("empty-dir"), 1_700_000_000, 42);
}

/// Bytes that differ by seed and position, cheap to make.
pub fn pattern_bytes(len: usize, seed: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(131)) as u8)
        .collect()
}

/// A file system mounted for one test (a small tmpfs to fill, a ramfs that refuses
/// O_DIRECT), unmounted on drop. Needs root; `None` (and a note) otherwise.
pub struct Mount {
    pub path: PathBuf,
}

impl Mount {
    pub fn new(path: PathBuf, fstype: &str, options: &str) -> Option<Mount> {
        if !is_root() {
            eprintln!("skipped: mounting a {fstype} needs root");
            return None;
        }
        fs::create_dir_all(&path).unwrap();
        let status = Command::new("mount")
            .args(["-t", fstype, "-o", options, fstype])
            .arg(&path)
            .status()
            .expect("run mount");
        if !status.success() {
            eprintln!("skipped: cannot mount a {fstype} here");
            return None;
        }
        Some(Mount { path })
    }
}

impl Mount {
    /// A fresh ext4 file system of `size` bytes in the image file `image`, mounted
    /// through a loop device at `path`.
    pub fn ext4_image(image: &Path, size: u64, path: PathBuf) -> Option<Mount> {
        if !is_root() {
            eprintln!("skipped: mounting a loop device needs root");
            return None;
        }
        fs::File::create(image).unwrap().set_len(size).unwrap();
        let made = Command::new("mkfs.ext4")
            .args(["-q", "-F"])
            .arg(image)
            .status()
            .is_ok_and(|s| s.success());
        if !made {
            eprintln!("skipped: mkfs.ext4 is not available");
            return None;
        }
        Mount::loop_image(image, path)
    }

    /// The file system in `image` mounted through a loop device at `path` (its journal
    /// replayed, as after a crash).
    pub fn loop_image(image: &Path, path: PathBuf) -> Option<Mount> {
        fs::create_dir_all(&path).unwrap();
        let status = Command::new("mount")
            .args(["-t", "ext4", "-o", "loop"])
            .arg(image)
            .arg(&path)
            .status()
            .expect("run mount");
        if !status.success() {
            eprintln!("skipped: cannot mount a loop device here");
            return None;
        }
        Some(Mount { path })
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.path).status();
    }
}

/// The bytes of `tree` a receiver can write with O_DIRECT at `block` size: the 4 KiB
/// multiples of each file that spans more than one block (single-block files go
/// through the page cache by design).
pub fn direct_writable_bytes(tree: &Path, block: u64) -> u64 {
    let mut total = 0;
    for entry in fs::read_dir(tree).unwrap() {
        let entry = entry.unwrap();
        let meta = fs::symlink_metadata(entry.path()).unwrap();
        if meta.is_dir() {
            total += direct_writable_bytes(&entry.path(), block);
        } else if meta.is_file() && meta.len() > block {
            total += meta.len() / 4096 * 4096;
        }
    }
    total
}

/// The receiving side (`prefix` "" for this one, "peer_" for the server) reports the
/// write mode it used and the bytes that bypassed the page cache: all of the aligned ones
/// when direct, unless its file system refused O_DIRECT, which it must then say (any
/// other fallback, such as blocks that were not aligned, fails).
pub fn assert_writes_reported(json: &serde_json::Value, prefix: &str, mode: &str, aligned: u64) {
    let field = |name: &str| &json[format!("{prefix}{name}")];
    assert_eq!(field("io"), mode, "{json}");
    let direct = field("direct_bytes")
        .as_u64()
        .expect("direct_bytes reported");
    match (mode, field("io_fallback").as_str()) {
        ("buffered", None) => assert_eq!(direct, 0, "{json}"),
        ("direct", None) => assert_eq!(direct, aligned, "{json}"),
        ("direct", Some(why)) => {
            let refused = "O_DIRECT: the destination's file system refused it";
            assert!(why.starts_with(refused) && direct == 0, "{json}");
        }
        _ => panic!("unexpected report {json}"),
    }
}
