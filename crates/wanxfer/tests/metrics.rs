//! Running as a service (issue 21, items 2 and 3): the metrics endpoint scraped during
//! and after transfers and read by Prometheus's own Python parsers, and the transfer log
//! whose lines must match the transfers made.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

/// One sample: metric name, labels, value.
type Sample = (String, BTreeMap<String, String>, f64);

/// The sparse file pushed: large enough that the push is still running when the
/// client is frozen right after the server's temporary file appears.
const LARGE: u64 = 1 << 30;

/// The address of the metrics endpoint, from the server's log.
fn metrics_addr(server: &Server) -> String {
    let mut addr = None;
    wait_for("the metrics line", Duration::from_secs(20), || {
        addr = server.log().lines().find_map(|l| {
            l.split("metrics at http://")
                .nth(1)
                .and_then(|rest| rest.strip_suffix("/metrics"))
                .map(str::to_string)
        });
        addr.is_some()
    });
    addr.unwrap()
}

/// GETs `path`: the status line, the headers and the body.
fn http_get(addr: &str, path: &str) -> (String, String, String) {
    let mut conn = TcpStream::connect(addr).expect("connect to the metrics endpoint");
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(conn, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    let (status, headers) = head.split_once("\r\n").unwrap_or((head, ""));
    (status.to_string(), headers.to_string(), body.to_string())
}

/// Parses an exposition with the Python Prometheus client's parsers: the OpenMetrics
/// one (strict: `# EOF`, counters ending in `_total`, units) and the classic text one
/// that Prometheus servers also accept. Returns the samples as the OpenMetrics parser
/// read them.
fn parse(text: &str) -> Vec<Sample> {
    const SCRIPT: &str = r##"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om
from prometheus_client.parser import text_string_to_metric_families as prom
text = sys.stdin.read()
samples = [[s.name, s.labels, s.value] for f in om(text) for s in f.samples]
classic = [s.name for f in prom(text.replace("# EOF\n", "")) for s in f.samples]
assert len(classic) == len(samples), (len(classic), len(samples))
print(json.dumps(samples))
"##;
    // Debian's python3-prometheus-client (scripts/install-deps.sh), not a pyenv's.
    let mut child = Command::new("/usr/bin/python3")
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the Prometheus parsers reject the exposition: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let parsed: Vec<(String, BTreeMap<String, String>, f64)> =
        serde_json::from_slice(&out.stdout).expect("the script prints JSON");
    parsed
}

fn scrape(addr: &str) -> (String, Vec<Sample>) {
    let (status, headers, body) = http_get(addr, "/metrics");
    assert!(status.contains("200"), "{status}");
    assert!(
        headers.contains("application/openmetrics-text"),
        "{headers}"
    );
    let samples = parse(&body);
    (body, samples)
}

/// The value of the one sample named `name` whose labels include `labels`; 0 if none
/// (a counter no event has created yet).
fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    let found: Vec<f64> = samples
        .iter()
        .filter(|(n, l, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, _, v)| *v)
        .collect();
    assert!(
        found.len() <= 1,
        "{name} {labels:?} is not one series: {found:?}"
    );
    found.first().copied().unwrap_or(0.0)
}

fn series(samples: &[Sample], name: &str) -> Vec<BTreeMap<String, String>> {
    samples
        .iter()
        .filter(|(n, _, _)| n == name)
        .map(|(_, l, _)| l.clone())
        .collect()
}

#[test]
fn metrics_and_transfer_log_match_the_transfers() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    fs::create_dir(&root).unwrap();
    let log_path = dir.path().join("transfers.log");
    let log_flag = log_path.to_str().unwrap();
    let server = Server::start(
        &root,
        &[
            "--metrics-listen",
            "127.0.0.1:0",
            "--transfer-log",
            log_flag,
        ],
    );
    let addr = metrics_addr(&server);

    // Before anything: parseable, the process's CPU counted, no session yet.
    let (_, before) = scrape(&addr);
    assert!(value(&before, "wanxfer_process_cpu_seconds_total", &[]) > 0.0);
    assert_eq!(
        value(&before, "wanxfer_sessions_active", &[("kind", "push")]),
        0.0
    );
    let (status, _, _) = http_get(&addr, "/other");
    assert!(status.contains("404"), "{status}");

    // A push, frozen mid-way so that it is scraped while it runs.
    let src = dir.path().join("big.bin");
    fs::File::create(&src).unwrap().set_len(LARGE).unwrap();
    let client = cp_command([
        "--streams=2".as_ref(),
        src.as_os_str(),
        server.url("big.bin").as_os_str(),
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_for(
        "the server's temporary file",
        Duration::from_secs(60),
        || !temp_files(&root).is_empty(),
    );
    signal(client.id() as i32, "STOP");
    // Throughput is sampled every second: wait for the session's and its channels' series
    // (a channel's once it moved bytes by a sample).
    let mut during = Vec::new();
    wait_for(
        "the session's throughput series",
        Duration::from_secs(20),
        || {
            during = scrape(&addr).1;
            !series(&during, "wanxfer_session_throughput_bytes_per_second").is_empty()
                && !series(&during, "wanxfer_channel_throughput_bytes_per_second").is_empty()
        },
    );
    signal(client.id() as i32, "CONT");
    assert_eq!(
        value(&during, "wanxfer_sessions_active", &[("kind", "push")]),
        1.0
    );
    let moved = value(
        &during,
        "wanxfer_transferred_bytes_total",
        &[("direction", "in")],
    );
    assert!(
        moved > 0.0 && moved <= LARGE as f64,
        "bytes in while running: {moved}"
    );
    let session = series(&during, "wanxfer_session_throughput_bytes_per_second");
    assert_eq!(session.len(), 1, "{session:?}");
    assert_eq!(session[0]["kind"], "push");
    assert!(session[0]["peer"].starts_with("127.0.0.1:"));
    let number = session[0]["session"].clone();
    let channels = series(&during, "wanxfer_channel_throughput_bytes_per_second");
    assert!(!channels.is_empty() && channels.len() <= 2, "{channels:?}");
    assert!(channels.iter().all(|l| l["session"] == number));
    let pool = value(
        &during,
        "wanxfer_pool_buffers",
        &[("session", &number), ("pool", "blocks")],
    );
    let in_use = value(
        &during,
        "wanxfer_pool_buffers_in_use",
        &[("session", &number), ("pool", "blocks")],
    );
    assert!(pool >= 1.0 && in_use <= pool, "pool {in_use}/{pool}");
    finish(client).assert_ok();

    // A pull of a small file, and a pull that fails (no such file).
    let small = pattern_bytes(1 << 20, 7);
    fs::write(root.join("small.bin"), &small).unwrap();
    let dest = dir.path().join("dest");
    fs::create_dir(&dest).unwrap();
    cp([&server.url("small.bin"), dest.as_os_str()]).assert_ok();
    assert_eq!(fs::read(dest.join("small.bin")).unwrap(), small);
    let failed = cp([
        "--retries=0".as_ref(),
        server.url("missing.bin").as_os_str(),
        dest.as_os_str(),
    ]);
    assert_ne!(failed.code, 0);
    // Remote operations are a session too.
    wanxfer("ls", [server.url("")]).assert_ok();

    // After: the counters are the transfers'; the sessions' own series are gone.
    let mut after = Vec::new();
    wait_for("the last session counted", Duration::from_secs(20), || {
        after = scrape(&addr).1;
        value(
            &after,
            "wanxfer_sessions_total",
            &[("kind", "op"), ("result", "ok")],
        ) == 1.0
    });
    let v = |name, labels: &[(&str, &str)]| value(&after, name, labels);
    assert_eq!(
        v("wanxfer_transferred_bytes_total", &[("direction", "in")]),
        LARGE as f64
    );
    assert_eq!(
        v("wanxfer_transferred_bytes_total", &[("direction", "out")]),
        small.len() as f64
    );
    assert_eq!(v("wanxfer_files_total", &[("direction", "in")]), 1.0);
    assert_eq!(v("wanxfer_files_total", &[("direction", "out")]), 1.0);
    assert_eq!(
        v(
            "wanxfer_sessions_total",
            &[("kind", "push"), ("result", "ok")]
        ),
        1.0
    );
    assert_eq!(
        v(
            "wanxfer_sessions_total",
            &[("kind", "pull"), ("result", "ok")]
        ),
        1.0
    );
    assert_eq!(
        v(
            "wanxfer_sessions_total",
            &[("kind", "pull"), ("result", "failed")]
        ),
        1.0
    );
    assert_eq!(v("wanxfer_sessions_active", &[("kind", "push")]), 0.0);
    assert_eq!(v("wanxfer_sessions_active", &[("kind", "pull")]), 0.0);
    assert!(series(&after, "wanxfer_session_throughput_bytes_per_second").is_empty());
    assert!(series(&after, "wanxfer_channel_throughput_bytes_per_second").is_empty());
    assert!(series(&after, "wanxfer_pool_buffers").is_empty());
    assert_eq!(v("wanxfer_partial_files_kept", &[]), 0.0);
    let errors: f64 = after
        .iter()
        .filter(|(n, _, _)| n == "wanxfer_errors_total")
        .map(|(_, _, v)| v)
        .sum();
    assert_eq!(
        errors,
        1.0,
        "one connection failed: {after:?}\n{}",
        server.log()
    );

    // The transfer log: a JSON line per session, in the order they ended (a failed one's
    // is written as the server's side ends, which may be just after the client exits).
    let text = wait_for_lines(&log_path, 4);
    let records: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(records.len(), 4, "{text}");
    let (push, pull, miss, op) = (&records[0], &records[1], &records[2], &records[3]);
    assert_eq!(op["direction"], "op");
    assert_eq!(op["result"], "ok");
    assert_eq!(push["direction"], "push");
    assert_eq!(push["paths"], serde_json::json!(["big.bin"]));
    assert_eq!(push["bytes"], LARGE);
    assert_eq!(push["files"], 1);
    assert_eq!(push["streams"], 2);
    assert_eq!(push["result"], "ok");
    assert_eq!(push["error_class"], serde_json::Value::Null);
    assert_eq!(push["session"].to_string(), number);
    assert_eq!(pull["direction"], "pull");
    assert_eq!(pull["paths"], serde_json::json!(["small.bin"]));
    assert_eq!(pull["bytes"], small.len());
    assert_eq!(pull["files"], 1);
    assert_eq!(miss["direction"], "pull");
    assert_eq!(miss["result"], "failed");
    assert_eq!(miss["paths"], serde_json::json!(["missing.bin"]));
    assert!(miss["error_class"].is_string(), "{miss}");
    assert_eq!(
        value(
            &after,
            "wanxfer_errors_total",
            &[("class", miss["error_class"].as_str().unwrap())]
        ),
        1.0
    );
    assert!(
        miss["error"].as_str().unwrap().contains("missing.bin"),
        "{miss}"
    );
    for r in &records {
        assert_eq!(r["identity"], "shared secret");
        assert_eq!(r["transport"], "tcp");
        assert!(r["encryption"] == "tls" || r["encryption"] == "ktls", "{r}");
        assert!(r["peer"].as_str().unwrap().starts_with("127.0.0.1:"));
        for time in ["start", "end"] {
            let t = r[time].as_str().unwrap();
            assert!(
                t.len() >= 20 && t.ends_with('Z') && t.as_bytes()[10] == b'T',
                "{t}"
            );
        }
        assert!(r["seconds"].as_f64().unwrap() >= 0.0);
        assert!(r["rate_bytes_per_s"].as_f64().unwrap() >= 0.0);
    }
    // The server's own paths never reach the log.
    assert!(!text.contains(root.to_str().unwrap()), "{text}");
}

/// logrotate's default: the file is renamed and the server starts a new one at the next
/// record.
#[test]
fn a_transfer_log_moved_away_is_created_anew() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    fs::create_dir(&root).unwrap();
    fs::write(root.join("a"), b"a").unwrap();
    let log_path = dir.path().join("transfers.log");
    let server = Server::start(&root, &["--transfer-log", log_path.to_str().unwrap()]);
    let dest = dir.path().join("dest");
    fs::create_dir(&dest).unwrap();
    cp([&server.url("a"), dest.as_os_str()]).assert_ok();
    wait_for_lines(&log_path, 1);
    let rotated = dir.path().join("transfers.log.1");
    fs::rename(&log_path, &rotated).unwrap();
    cp([&server.url("a"), dest.as_os_str()]).assert_ok();
    wait_for_lines(&log_path, 1);
    assert_eq!(fs::read_to_string(&rotated).unwrap().lines().count(), 1);
}

/// A script that reads the transfer log as soon as `cp` exits finds the session's
/// record: the server writes it before it tells the client the transfer is done. (Written
/// as the session ended instead, 3 pushes in a row found 0, then 2, then 3 records.)
#[test]
fn the_transfer_log_has_the_record_when_the_client_is_done() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    fs::create_dir(&root).unwrap();
    fs::write(root.join("a"), vec![7u8; 300_000]).unwrap();
    let log_path = dir.path().join("transfers.log");
    let server = Server::start(&root, &["--transfer-log", log_path.to_str().unwrap()]);
    let dest = dir.path().join("dest");
    fs::create_dir(&dest).unwrap();
    let src = dir.path().join("b");
    fs::write(&src, vec![9u8; 300_000]).unwrap();
    for round in 0..4 {
        cp([&server.url("a"), dest.as_os_str()]).assert_ok();
        let text = fs::read_to_string(&log_path).unwrap_or_default();
        assert_eq!(text.lines().count(), 2 * round + 1, "after a pull: {text}");
        cp([
            src.as_os_str(),
            server.url(&format!("b{round}")).as_os_str(),
        ])
        .assert_ok();
        let text = fs::read_to_string(&log_path).unwrap();
        assert_eq!(text.lines().count(), 2 * round + 2, "after a push: {text}");
        let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        assert_eq!(last["direction"], "push");
        assert_eq!(last["result"], "ok");
        assert_eq!(last["bytes"], 300_000);
    }
}

/// The file's text once it has `lines` lines.
fn wait_for_lines(path: &std::path::Path, lines: usize) -> String {
    let mut text = String::new();
    wait_for(
        "the transfer log's records",
        Duration::from_secs(20),
        || {
            text = fs::read_to_string(path).unwrap_or_default();
            text.lines().count() >= lines
        },
    );
    text
}
