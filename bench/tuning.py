#!/usr/bin/env python3
"""Issue 19: wanxfer with no tuning flags against iperf3 (-P 1/4/8, best) and wanxfer with
hand-chosen flags, memory to memory through wanxfer-emu, at 50 and 100 ms; with --paths,
the issue's six named paths (a)-(f) against iperf3 -P1/-P4 and GridFTP in one run.

Each figure is a ratio to the emulator's goodput ceiling (rate x 1448/1500: what TCP
payload can reach through a bottleneck of that rate), with CPU seconds per side: for
wanxfer its own --json (this process and the server's session threads), for iperf3 its
-J cpu_utilization_percent times the test's seconds. One emulator per run, so its own
counters (bytes out, drops) belong to that run alone and are kept in OUT.json.

usage: sudo bench/tuning.py [--rate 1gbit] [--rtts 50,100] [--bytes 2GiB] [--loss 0.0001]
                            [--hand "--streams 8"] [--out bench/runs/tuning]   (root)
       sudo bench/tuning.py --paths a,b,c,d,e,f [--scale 1] [--tools wanxfer,iperf3-P1,iperf3-P4,gridftp]
                            [--gridftp-p 4] [--repeat N] [--out bench/runs/paths]
Writes OUT.json and OUT.md. Smoke run: --bytes 64MiB --rtts 50, or --paths a --scale 0.1
(then the figures mostly measure slow start: say so when quoting them).

--paths: each transfer is 20 x the path's BDP (times --scale); (f) is sized for 10 s at each
of its rates. Besides `wanxfer` (the target's run: TLS over TCP, no flags), --tools takes
`wanxfer-plain` and `wanxfer-fabric` (TCP and the fabric transport, both --no-encryption):
their ratio is the fabric target's, and neither counts as a peer. For (f) wanxfer's --progress-json lines give, after each rate change, the
seconds until its 1 s rate (what its data sockets delivered) is within 10% of the new
ceiling. --repeat N runs every tool N times per path, interleaved (one run of each tool,
then the next round): single runs of one build spread by 10-20% on the long paths, too much
to compare builds by. The summary then stands on each tool's median run, and a table per
path gives every repetition's own ratio (and (f)'s recovery seconds). Where the best tool stays
below the ceiling while the emulator's forwarder is busy >= 90% of its wall time, the
summary marks the path emulator-bound: the figure is the emulator's ceiling on this
machine, and the best tool's goodput (iperf3 -P4 among them) is its floor.

iperf3 timed to its server's last byte. `iperf3 -n N` ends its test once N bytes are
written to its sockets, while socket buffers and the path still hold up to half of them
(its server had counted 56-100% of N on the six paths), and wanxfer's clock stops at the
receiver's verified commit of all N. Its plain run therefore only brackets it: delivered /
wall below, N / wall above. So each iperf3 tool runs a second time, sending N + X (X: 4 x
what the plain run's server lacked, at least N / 2, doubled and rerun if the server still
ends short of N), its server reporting 0.1 s intervals (`-s -i 0.1 -J`, handed back by the
client's `--get-server-output`). The first N bytes travel as in an N-byte run; the time
`reached` at which the server's cumulative count passes N is interpolated linearly within
its interval (the interval's ends bound it). The exact whole command is then

    wall - (server_end - reached)

where server_end is TEST_END's arrival on the server's clock, which ends its count and
starts the result exchange: the command's set-up, its data phase up to N received and its
result exchange are all kept, as wanxfer's set-up and final verification are in its wall;
only the stretch from N received to TEST_END's arrival is cut. Both times are on the
server's clock, so no offset between the two clocks is needed. (Replacing the client's
data phase by `reached` would need one: the server's clock starts when it sends
TEST_START, the client's when that arrives, and TEST_END reaches the server a one-way delay
plus the bottleneck queue after the client's last write; the recorded `end_skew_s`, server
end less client end, is RTT plus that queue on the emulated paths and ~0 on loopback.)
Caveat, against iperf3: its result exchange sends the client's results through the
bottleneck queue the extra bytes keep full (a drop there costs a retransmission timeout),
which a run stopping at N would have drained. So a third run sends 1 KiB on the idle path:
its wall less its server's end is iperf3's set-up and result exchange with no queue
(`idle_overhead_s`), and `reached` plus that is the reading most favourable to iperf3,
which the summary also compares against. Each iperf3 tool thus takes three runs. Only
this script times iperf3 -n on an emulated path; bench/peers.py's -n runs are on
loopback, where its server must count >= 99% of N.
"""
import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# WANXFER_BIN_DIR: binaries built elsewhere (then nothing is built).
BIN_DIR = os.environ.get("WANXFER_BIN_DIR")
REL = BIN_DIR or os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release")
RIGHT = "10.77.0.2"
SECRET = "tuning-bench-0123456789abcdef"
# Per process, so two bench scripts can run at once without reading each other's output.
OUT_FILE = f"/tmp/wanxfer-tuning-bench-{os.getpid()}.out"


def rate_bps(text):
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, m in units.items():
        if text.endswith(u):
            return float(text[: -len(u)]) * m
    return float(text)


def emulate(rtt_ms, rate, loss, right, left, buffer=None, steps=(), timeout=3600):
    """Runs `left` against `right` through a fresh emulated path; returns the left
    command's output (written to OUT_FILE), the emulator's report and its stderr.
    `steps` are wanxfer-emu --rate-step values ("10s=500mbit"); the emulator is always
    torn down: it kills the right command when the left one ends, and on a timeout this
    process kills the emulator's whole process group (it then removes its namespaces on
    SIGTERM via its Ctrl-C handler)."""
    bps = rate_bps(rate)
    bdp = int(bps * rtt_ms / 1e3 / 8)
    if os.path.exists(OUT_FILE):
        os.unlink(OUT_FILE)
    cmd = [
        f"{REL}/wanxfer-emu", "--cpu", "1", "--rtt", f"{rtt_ms}ms", "--rate", rate,
        "--buffer", str(buffer if buffer is not None else max(1_000_000, bdp)),
        "--tcp-mem", str(max(64 << 20, 4 * bdp)),
        "--loss", str(loss), "--settle", "1",
        *[x for s in steps for x in ("--rate-step", s)],
        "--right", right,
        "--left", f"taskset -c 0 sh -c {shlex.quote('( ' + left + ' ) > ' + OUT_FILE)}",
    ]
    env = dict(os.environ, WANXFER_SECRET=SECRET, WANXFER_STATE_DIR="/tmp/wanxfer-tuning-bench-state")
    started = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        text, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGINT)  # the emulator's Ctrl-C handler tears it down
        try:
            text, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            text, err = p.communicate()
        raise benchlib.ToolError(f"timed out after {timeout} s: {' '.join(cmd[:8])} ...: {err[-300:]}")
    report = json.loads(text[text.index("{"):]) if "{" in text else {}
    report["_started_unix_s"] = started
    try:
        with open(OUT_FILE) as f:
            out = f.read()
        os.unlink(OUT_FILE)
    except OSError:
        out = ""
    return out, report, err


def path_of(rtt_ms, rate, loss, buffer=None, steps=()):
    return {"rtt_ms": rtt_ms, "rate": rate, "loss": loss, "buffer": buffer, "steps": list(steps)}


def run_path(path, right, left, timeout):
    return emulate(path["rtt_ms"], path["rate"], path["loss"], right, left, buffer=path["buffer"],
                   steps=path["steps"], timeout=timeout)


def emu_summary(report):
    fwd = report.get("forward", {})
    wall = report.get("wall_seconds") or 0
    return {**{k: fwd.get(k) for k in ("bytes_out", "dropped_queue", "dropped_loss")},
            # The forwarder's CPU over its wall time: near 1.0, the emulator (one core) is
            # the bottleneck rather than the emulated link.
            "busy": (report.get("cpu_seconds") or 0) / wall if wall else None}


def timed(cmd):
    """`cmd` in a shell snippet that also prints `WALL start end status`: the whole command,
    process start to exit, set-up and tear-down included, timed alike for every tool."""
    return f"s=$(date +%s.%N); {cmd}; rc=$?; e=$(date +%s.%N); echo WALL $s $e $rc"


def wall_of(out):
    """(seconds, output without the WALL line) of a `timed` command's output."""
    walls = [line.split()[1:] for line in out.splitlines() if line.startswith("WALL ")]
    rest = "\n".join(line for line in out.splitlines() if not line.startswith("WALL "))
    return (float(walls[-1][1]) - float(walls[-1][0]) if walls else None), rest


# The wanxfer tools --paths knows: the target's (TLS over TCP), and the two that compare
# the transports alone (issue 19's fabric target), both unencrypted so that only the
# transport differs: (server flags, client flags).
WANXFER_TOOLS = {
    "wanxfer": ("", ""),
    "wanxfer-plain": ("--allow-unencrypted", "--no-encryption"),
    "wanxfer-fabric": ("--transport fabric --allow-unencrypted", "--transport fabric --no-encryption"),
}


def wanxfer(path, size, flags, timeout=3600, progress=False, tool="wanxfer"):
    serve_flags, cp_flags = WANXFER_TOOLS[tool]
    flags = f"{cp_flags} {flags}".strip()
    right = f"{REL}/wanxfer serve --root /tmp --listen {RIGHT}:7800 {serve_flags} >/dev/null 2>&1"
    left = "date +START%s.%N; " + timed(f"{REL}/wanxfer cp --json --quiet {'--progress-json ' if progress else ''}"
                                        f"{flags} --bytes {size} /dev/zero wanxfer://{RIGHT}:7800/dev/null")
    out, report, err = run_path(path, right, left, timeout)
    wall, out = wall_of(out)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        raise benchlib.ToolError(f"wanxfer {flags}: no result: {err[-500:]}")
    r = json.loads(lines[-1])
    tuning = r.get("tuning") or {}
    row = {
        "gbit_per_s": r["gbit_per_s"],
        "seconds": r["seconds"],
        "wall_s": wall,
        "client_cpu_s": r["cpu_user_s"] + r["cpu_sys_s"],
        "server_cpu_s": r["peer_cpu_user_s"] + r["peer_cpu_sys_s"],
        "streams": r["streams"],
        "channels": len(r.get("channels") or []),
        "channels_cut": r.get("channels_cut", 0),
        "channels_held_back": r.get("channels_held_back", 0),
        "decisions": tuning.get("decisions"),
        "min_rtt_ms": tuning.get("min_rtt_ms"),
        "emu": emu_summary(report),
    }
    if progress:
        starts = [float(line[5:]) for line in out.splitlines() if line.startswith("START")]
        # The emulator's clock starts between its launch and the left command's start
        # (less the settle time): taking its launch makes every time after a rate change
        # an upper bound, and `offset_uncertainty_s` says by how much at most.
        t0 = report["_started_unix_s"]
        row["cp_start_after_emu_s"] = starts[0] - t0 if starts else None
        # What the data sockets delivered (`network_bits_per_s`): the block count
        # (`bits_per_s`) steps by 4 MiB a line, 7% of a second at 500 Mbit/s.
        row["progress"] = [{"t_s": (starts[0] - t0 if starts else 0) + p["t_s"],
                            "bits_per_s": benchlib.line_rate(p),
                            "block_bits_per_s": p["bits_per_s"], "streams": p.get("streams")}
                           for p in map(json.loads, lines[:-1]) if p.get("event") == "progress"]
    return row


def iperf3(path, size, parallel, timeout=3600):
    """iperf3 -n SIZE as it stands (its own figures, its CPU, its bounds by the bytes its
    server counted), then the time until its server had received SIZE, from a second,
    longer run (`iperf3_exact`; the module's docstring says why)."""
    right = "iperf3 -s -1 >/dev/null 2>&1"
    left = timed(f"iperf3 -c {RIGHT} -J -P {parallel} -n {size}")
    out, report, err = run_path(path, right, left, timeout)
    started = [float(line.split()[1]) for line in out.splitlines() if line.startswith("WALL ")]
    wall, out = wall_of(out)
    try:
        r = json.loads(out)
        end = r["end"]
        seconds = end["sum_received"]["seconds"]
        cpu = end["cpu_utilization_percent"]
    except (ValueError, KeyError) as e:
        raise benchlib.ToolError(f"iperf3 -P {parallel}: {e}: {out[-300:]} {err[-300:]}")
    # Its 1 s intervals on the emulator's clock, as wanxfer's progress lines are: from
    # the command's start, so (as for wanxfer) an upper bound by its set-up.
    t0 = report["_started_unix_s"]
    offset = started[0] - t0 if started else 0.0
    progress = [{"t_s": offset + i["sum"]["end"], "bits_per_s": i["sum"]["bits_per_second"]}
                for i in r.get("intervals", [])]
    row = {
        "gbit_per_s": end["sum_received"]["bits_per_second"] / 1e9,
        "seconds": seconds,
        "wall_s": wall,
        "progress": progress,
        # What reached the server: `-n` ends the test once the bytes are written, so up
        # to a window of them may still be in flight when the command's clock stops.
        "delivered_bytes": end["sum_received"].get("bytes"),
        "client_cpu_s": cpu["host_total"] / 100 * seconds,
        "server_cpu_s": cpu["remote_total"] / 100 * seconds,
        "streams": parallel,
        "emu": emu_summary(report),
    }
    undelivered = max(0, size - (row["delivered_bytes"] or 0))
    try:
        row["exact"] = iperf3_exact(path, size, parallel, undelivered, timeout)
    except benchlib.ToolError as e:
        print(f"iperf3 -P {parallel} exact: {e}", file=sys.stderr, flush=True)
        row["exact"] = {"error": " ".join(str(e).split())}
    return row


def server_reached(intervals, size):
    """When the server's cumulative count reached `size`, from its intervals (server clock,
    seconds from its test start): (interpolated time, interval start, interval end), the
    count assumed linear within the interval; None if it never did."""
    total = 0
    for iv in intervals:
        b = iv["bytes"]
        if b > 0 and total + b >= size:
            return iv["start"] + (size - total) / b * (iv["end"] - iv["start"]), iv["start"], iv["end"]
        total += b
    return None


def iperf3_counted(path, parallel, total, timeout):
    """iperf3 -n `total` with its server's 0.1 s intervals (`-s -i 0.1 -J`, returned by
    `--get-server-output`): the whole command's wall, the client's end (its last write,
    client clock), the server's end (TEST_END's arrival, server clock), what the server
    counted, its intervals and the emulator's report."""
    right = "iperf3 -s -1 -J -i 0.1 >/dev/null 2>&1"
    left = timed(f"iperf3 -c {RIGHT} -J -P {parallel} -n {total} --get-server-output")
    out, report, err = run_path(path, right, left, timeout)
    wall, out = wall_of(out)
    try:
        r = json.loads(out)
        srv = r["server_output_json"]
        got = {"wall_s": wall, "client_end_s": r["end"]["sum_sent"]["end"],
               "server_end_s": srv["end"]["sum_received"]["end"],
               "server_bytes": srv["end"]["sum_received"]["bytes"],
               "intervals": [i["sum"] for i in srv["intervals"]], "report": report}
    except (ValueError, KeyError, TypeError) as e:
        raise benchlib.ToolError(f"iperf3 -P {parallel} -n {total} --get-server-output: {e}: "
                                 f"{out[-300:]} {err[-300:]}")
    if wall is None:
        raise benchlib.ToolError(f"iperf3 -P {parallel} -n {total}: no wall time: {err[-300:]}")
    return got


def iperf3_exact(path, size, parallel, undelivered, timeout, attempts=3):
    """The whole command of an iperf3 that ended when its server had received `size`:
    iperf3 sends more than `size` (so the test goes on past the moment) and the time its
    server's count reached `size` is interpolated within its 0.1 s interval. The extra to
    send is 4 x what the plain run's server lacked at its end (at least size / 2), doubled
    on each attempt where the server still ended short of `size`. A third, 1 KiB run on the
    idle path times iperf3's own set-up and result exchange where no queue is left to
    drain: the reading most favourable to iperf3."""
    extra = max(4 * undelivered, size // 2, 8 << 20)
    tried = []
    for _ in range(attempts):
        total = size + extra
        run = iperf3_counted(path, parallel, total, timeout * total / size)
        intervals, s_end, c_end = run["intervals"], run["server_end_s"], run["client_end_s"]
        reached = server_reached(intervals, size)
        tried.append({"sent_bytes": total, "server_bytes": run["server_bytes"]})
        if reached is None:
            extra *= 2
            continue
        t_n, lo, hi = reached
        idle = iperf3_counted(path, parallel, 1024, timeout)
        # Command start to the server's test start, and TEST_END's arrival to exit.
        idle_overhead = idle["wall_s"] - idle["server_end_s"]
        return {
            "sent_bytes": total,
            "attempts": tried,
            "wall_s": run["wall_s"],
            # Server clock: its test start (TEST_START sent) to the moment its count reached
            # `size`, with the interval that holds it, and to TEST_END's arrival.
            "server_reached_s": t_n,
            "server_reached_in_s": [lo, hi],
            "server_end_s": s_end,
            # Client clock: its test start (TEST_START received) to its last write.
            "client_end_s": c_end,
            "server_bytes": run["server_bytes"],
            "server_intervals_bytes": sum(i["bytes"] for i in intervals),
            # The interval where the first data arrived: one RTT after the server's start
            # if TEST_START's trip to the client and the first data's back take one each.
            "server_first_bytes_in_s": next(([i["start"], i["end"]] for i in intervals if i["bytes"] > 0), None),
            # Server's end less the client's, on their own clocks: the server starts one
            # one-way delay earlier and TEST_END arrives one one-way delay (plus the
            # bottleneck queue it waits in) later, so about RTT + that queue.
            "end_skew_s": s_end - c_end,
            "skew_less_rtt_s": s_end - c_end - path["rtt_ms"] / 1e3,
            # Everything but the stretch from `size` received to TEST_END received: the
            # set-up, the server's test up to `size`, and its result exchange.
            "exact_wall_s": run["wall_s"] - (s_end - t_n),
            "exact_wall_range_s": [run["wall_s"] - (s_end - lo), run["wall_s"] - (s_end - hi)],
            "idle_wall_s": idle["wall_s"],
            "idle_server_end_s": idle["server_end_s"],
            "idle_overhead_s": idle_overhead,
            "overhead_s": run["wall_s"] - s_end,
            # The same data phase with the idle run's set-up and result exchange.
            "exact_idle_wall_s": t_n + idle_overhead,
            "emu": emu_summary(run["report"]),
        }
    raise benchlib.ToolError(f"iperf3 -P {parallel}: the server never counted {size} bytes: {tried}")


def gridftp(path, size, parallel, tcp_bs, timeout=3600):
    """globus-url-copy memory to memory (/dev/zero to /dev/null) as bench/peers.py runs it,
    with hand-chosen -p and -tcp-bs. The server takes one connection (-1) and exits, so
    /usr/bin/time on each side sees all its CPU (its forked session child included)."""
    pid = os.getpid()
    srv_time, cli_time = f"/tmp/wanxfer-tuning-gridftp-server-{pid}.time", f"/tmp/wanxfer-tuning-gridftp-client-{pid}.time"
    for f in (srv_time, cli_time):
        if os.path.exists(f):
            os.unlink(f)
    # In a namespace the host's DNS is out of reach and Globus resolves the host name
    # (for its contact strings, and for the address PASV advertises): each side gets a
    # private /etc/hosts naming its own address first, and the server -data-interface.
    hosts = {}
    host = socket.gethostname()
    for side, ip in (("right", RIGHT), ("left", "10.77.0.1")):
        hosts[side] = f"/tmp/wanxfer-tuning-hosts-{side}-{pid}"
        with open("/etc/hosts") as src, open(hosts[side], "w") as dst:
            dst.write(f"{ip} {host}\n" + src.read())

    def private_hosts(side, cmd):
        return f"unshare -m sh -c {shlex.quote(f'mount --bind {hosts[side]} /etc/hosts && exec {cmd}')}"
    right = private_hosts("right", f"/usr/bin/time -f '%U %S' -o {srv_time} globus-gridftp-server -aa "
                          f"-anonymous-user nobody -p 2811 -d error -1 -data-interface {RIGHT}") + " >/dev/null 2>&1"
    # The server may take longer than the emulator's settle time to listen on a loaded
    # machine: a refused connection does not use up its one connection, so retry those.
    gout = f"/tmp/wanxfer-tuning-gridftp-client-{pid}.out"
    client = private_hosts("left", f"/usr/bin/time -f '%U %S' -o {cli_time} globus-url-copy -vb -fast -p {parallel} "
                           f"-tcp-bs {tcp_bs} -len {size} file:///dev/zero ftp://{RIGHT}:2811/dev/null")
    left = (f"i=0; while :; do s=$(date +%s.%N); {client} > {gout} 2>&1; "
            f"rc=$?; e=$(date +%s.%N); if [ $rc = 0 ] || ! grep -q 'Connection refused' {gout} || [ $i -ge 40 ]; "
            f"then break; fi; i=$((i+1)); sleep 0.5; done; cat {gout}; echo WALL $s $e $rc; sleep 1")
    out, report, err = run_path(path, right, left, timeout)
    counted = [int(w.split()[0]) for w in out.replace("\r", "\n").splitlines() if w.strip().endswith("inst")]
    walls = [line.split()[1:] for line in out.splitlines() if line.startswith("WALL ")]
    # -vb prints its count about once a second, so a short transfer may print none: then
    # the client's exit status (0: every byte of -len acknowledged) is the check.
    if not walls or walls[0][2] != "0" or (counted and counted[-1] != size):
        raise benchlib.ToolError(f"globus-url-copy -p {parallel}: counted {counted[-1:] or 'nothing'} of {size} "
                                 f"bytes: {out[-300:]} {err[-300:]}")
    seconds = float(walls[0][1]) - float(walls[0][0])

    def cpu(f):
        try:
            with open(f) as fh:
                u, s = fh.read().split()[-2:]
            return float(u) + float(s)
        except (OSError, ValueError):
            return None
    return {"gbit_per_s": size * 8 / seconds / 1e9, "seconds": seconds, "wall_s": seconds, "client_cpu_s": cpu(cli_time),
            "server_cpu_s": cpu(srv_time), "streams": parallel, "tcp_bs": tcp_bs, "emu": emu_summary(report)}


# The issue's six paths. Where it names no buffer, a BDP-sized one (at least 1 MB); (f)'s
# RTT is not named: 50 ms.
PATHS = {
    "a": {"rtt_ms": 50, "rate": "2gbit", "loss": 0.0, "buffer": 1_000_000, "steps": [],
          "what": "50 ms, 2 Gbit/s, 1 MB drop-tail buffer (shallow policer)"},
    "b": {"rtt_ms": 100, "rate": "1gbit", "loss": 0.0001, "buffer": "bdp", "steps": [],
          "what": "100 ms, 1 Gbit/s, BDP buffer, 0.01% random loss"},
    "c": {"rtt_ms": 200, "rate": "500mbit", "loss": 0.0, "buffer": "bdp", "steps": [],
          "what": "200 ms, 500 Mbit/s, BDP buffer"},
    "d": {"rtt_ms": 200, "rate": "4gbit", "loss": 0.0, "buffer": "bdp", "steps": [],
          "what": "200 ms, 4 Gbit/s, BDP buffer"},
    "e": {"rtt_ms": 30, "rate": "4gbit", "loss": 0.0, "buffer": "bdp", "steps": [],
          "what": "30 ms, 4 Gbit/s, BDP buffer"},
    "f": {"rtt_ms": 50, "rate": "2gbit", "loss": 0.0, "buffer": "bdp", "steps": ["10s=500mbit", "20s=2gbit"],
          "what": "50 ms, 2 Gbit/s, 500 Mbit/s from 10 s, 2 Gbit/s again from 20 s, BDP buffer (at 2 Gbit/s)"},
}
GOODPUT = 1448 / 1500


def schedule(path):
    """[(from_s, bits/s)] of the path's bottleneck."""
    out = [(0.0, rate_bps(path["rate"]))]
    for s in path["steps"]:
        at, r = s.split("=")
        out.append((float(at.rstrip("s")), rate_bps(r)))
    return out


def mean_ceiling(path, t0, t1):
    """Goodput ceiling (Gbit/s) averaged over [t0, t1] seconds of the emulator's clock."""
    sched = schedule(path) + [(float("inf"), 0)]
    total = 0.0
    for (a, r), (b, _) in zip(sched, sched[1:]):
        lo, hi = max(a, t0), min(b, t1)
        if hi > lo:
            total += (hi - lo) * r
    return total / (t1 - t0) * GOODPUT / 1e9 if t1 > t0 else schedule(path)[0][1] * GOODPUT / 1e9


def recovery(path, progress, within=0.10):
    """For each rate change: seconds until a progress line's rate (1 s average) is first
    within `within` of the new ceiling, and the share of later lines (until the next
    change) that stay within it."""
    sched = schedule(path)
    out = []
    for i, (at, r) in enumerate(sched[1:], 1):
        until = sched[i + 1][0] if i + 1 < len(sched) else float("inf")
        target = r * GOODPUT
        after = [p for p in progress if at < p["t_s"] <= until]
        ok = [p for p in after if abs(p["bits_per_s"] - target) <= within * target]
        first = ok[0]["t_s"] - at if ok else None
        later = [p for p in after if first is not None and p["t_s"] >= ok[0]["t_s"]]
        out.append({"at_s": at, "to_gbit_per_s": r / 1e9, "seconds_to_within": first,
                    "lines_after": len(after),
                    "share_within_after": (sum(1 for p in later if abs(p["bits_per_s"] - target) <= within * target)
                                           / len(later)) if later else None})
    return out


def enrich(r, k, path, spec, size, ceiling):
    """Adds the whole-command figures and the share of the ceiling to one run's result."""
    # Bytes that arrived (iperf3's own count, where it has one) over the whole command.
    delivered = r.get("delivered_bytes") or size
    r["wall_gbit_per_s"] = delivered * 8 / r["wall_s"] / 1e9 if r.get("wall_s") else None
    # All the bytes asked for over the command: iperf3's upper bound.
    r["wall_gbit_per_s_asked"] = size * 8 / r["wall_s"] / 1e9 if r.get("wall_s") else None
    # The whole command until the receiver had every byte: wanxfer's and GridFTP's wall as
    # it is (both end on the receiver's word), iperf3's from its longer run (module
    # docstring); the comparison the target means.
    x = r.get("exact")
    if x is None and not k.startswith("iperf3"):
        r["exact_wall_s"] = r.get("wall_s")
    elif x and "error" not in x:
        r["exact_wall_s"] = x["exact_wall_s"]
        # Its result exchange may have waited behind a bottleneck queue that an iperf3
        # stopping at `size` would have drained: with the idle run's set-up and exchange
        # where shorter, the reading most favourable to iperf3.
        r["exact_gbit_per_s_idle"] = size * 8 / min(x["exact_wall_s"], x["exact_idle_wall_s"]) / 1e9
    r["exact_gbit_per_s"] = size * 8 / r["exact_wall_s"] / 1e9 if r.get("exact_wall_s") else None
    start = r.get("cp_start_after_emu_s") or 1.0
    r["ceiling_gbit_per_s"] = mean_ceiling(path, start, start + r["seconds"]) if spec["steps"] else ceiling
    r["of_ceiling"] = r["gbit_per_s"] / r["ceiling_gbit_per_s"]


def figure(r):
    """A run's goodput for ranking: its exact whole-command figure where it has one."""
    return r.get("exact_gbit_per_s") or r.get("gbit_per_s") or 0.0


def median_run(runs):
    """The run with the median figure among those that worked (the lower middle of an
    even count), or the first failure if none did."""
    good = sorted((r for r in runs if "error" not in r), key=figure)
    return good[(len(good) - 1) // 2] if good else runs[0]


def run_paths(a):
    """The issue's targets: every tool on every named path in one run."""
    tools = a.tools.split(",")
    bad = [t for t in tools if t not in WANXFER_TOOLS and t != "gridftp"
           and not re.fullmatch(r"iperf3-P[1-9][0-9]*", t)]
    if bad:
        sys.exit(f"--tools: unknown {', '.join(bad)} ({', '.join(WANXFER_TOOLS)}, iperf3-PN, gridftp)")
    need = (["iperf3"] if any(t.startswith("iperf3") for t in tools) else []) + \
        (["globus-url-copy", "globus-gridftp-server", "/usr/bin/time"] if "gridftp" in tools else [])
    missing = [t for t in need if not shutil.which(t)]
    if missing:
        sys.exit(f"not installed: {', '.join(missing)} (apt-get install iperf3 globus-gass-copy-progs "
                 "globus-gridftp-server-progs time), or leave the tool out of --tools")
    rows, summaries = [], []
    for name in a.paths.split(","):
        if name not in PATHS:
            sys.exit(f"--paths: unknown path {name!r}; the issue's paths are {','.join(PATHS)}")
        spec = PATHS[name]
        top = max(r for _, r in schedule(spec))
        bdp = int(top * spec["rtt_ms"] / 1e3 / 8)
        path = dict(spec, buffer=max(1_000_000, bdp) if spec["buffer"] == "bdp" else spec["buffer"])
        if spec["steps"]:
            # Long enough to see both changes and 10 s after the second at the full rate.
            full = int(sum(r * 10 for _, r in schedule(spec)) / 8)
        else:
            full = 20 * bdp
        size = max(int(full * a.scale), 8 << 20)
        timeout = max(120, size * 8 / (rate_bps(spec["rate"]) / 4) + 60)
        ceiling = rate_bps(spec["rate"]) * GOODPUT / 1e9
        def run_tool(tool):
            """(label, result) of one run of `tool`; an error becomes the result."""
            label = tool
            try:
                if tool in WANXFER_TOOLS:
                    return label, wanxfer(path, size, a.flags, timeout, progress=True, tool=tool)
                if tool.startswith("iperf3-P"):
                    return label, iperf3(path, size, int(tool[len("iperf3-P"):]), timeout)
                p = a.gridftp_p
                tcp_bs = max(1 << 20, -(-2 * bdp // p))
                label = f"gridftp -p {p} -tcp-bs {tcp_bs}"
                return label, gridftp(path, size, p, tcp_bs, timeout)
            except benchlib.ToolError as e:
                print(f"path {name} {tool}: {e}", file=sys.stderr, flush=True)
                return label, {"error": " ".join(str(e).split())}

        # Every tool once per repetition, interleaved, so that a slow spell of the machine
        # falls on all of them alike.
        reps = {}
        for rep in range(a.repeat):
            for tool in tools:
                k, r = run_tool(tool)
                r.update(tool=k, path=name, rep=rep + 1)
                if "error" not in r:
                    enrich(r, k, path, spec, size, ceiling)
                reps.setdefault(k, []).append(r)
                rows.append({k2: v for k2, v in r.items() if k2 != "progress"})
                print(json.dumps(rows[-1]), flush=True)
        # Each tool's median run (by its exact figure) stands for it in the summary.
        runs = {k: median_run(v) for k, v in reps.items()}
        ok = {k: r for k, r in runs.items() if "error" not in r}
        peers = [r for k, r in ok.items() if k not in WANXFER_TOOLS]
        best_peer = max(peers, key=lambda r: r["gbit_per_s"]) if peers else None
        best = max(ok.values(), key=lambda r: r["gbit_per_s"]) if ok else None
        summary = {"path": name, "what": spec["what"], "bytes": size, "bdp": bdp, "buffer": path["buffer"],
                   "ceiling_gbit_per_s": ceiling,
                   "best_tool": best and best["tool"], "best_gbit_per_s": best and best["gbit_per_s"],
                   # What the emulator itself carried at most on this path in this run: the
                   # best tool's goodput, with the forwarder's busy share. Where that share is
                   # near 1, it is the emulator's own ceiling, not the path's.
                   "emu_floor_gbit_per_s": best and best["gbit_per_s"],
                   "emu_busy_at_best": best and best["emu"]["busy"],
                   "emu_bound": bool(best and (best["emu"]["busy"] or 0) >= 0.9
                                     and best["gbit_per_s"] < 0.9 * ceiling)}
        w = ok.get("wanxfer")
        if w and best_peer:
            summary["wanxfer_vs_best_peer"] = w["gbit_per_s"] / best_peer["gbit_per_s"]
            summary["best_peer"] = best_peer["tool"]
            # By the whole command: against every peer's exact figure (the target's
            # comparison), against its reading most favourable to iperf3, and against
            # iperf3's old bounds (delivered / wall: lower; asked / wall: upper), kept so
            # records compare. wanxfer's and GridFTP's wall is exact already. A peer with
            # no figure leaves the ratio out rather than crowning another.
            for key, field in (("exact", "exact_gbit_per_s"), ("exact_idle", "exact_gbit_per_s_idle"),
                               ("wall", "wall_gbit_per_s"), ("upper", "wall_gbit_per_s_asked")):
                figs = {r["tool"]: r.get(field) or r.get("exact_gbit_per_s") for r in peers}
                if w.get("exact_gbit_per_s") and all(figs.values()):
                    top = max(figs, key=figs.get)
                    summary[f"wanxfer_vs_best_peer_{key}"] = w["exact_gbit_per_s"] / figs[top]
                    summary[f"best_peer_{key}"] = top
        if w:
            summary["wanxfer_of_ceiling"] = w["of_ceiling"]
            if spec["steps"]:
                summary["recovery"] = recovery(path, w["progress"])
                # The same measure of iperf3 with one stream: how fast the kernel's
                # congestion control alone gets there, the floor for any tool on it.
                i1 = ok.get("iperf3-P1")
                if i1 and i1.get("progress"):
                    summary["recovery_iperf3_p1"] = recovery(path, i1["progress"])
                summary["cp_start_after_emu_s"] = w["cp_start_after_emu_s"]
                summary["progress"] = w["progress"]
        fab, plain = ok.get("wanxfer-fabric"), ok.get("wanxfer-plain")
        if fab and plain:
            # The fabric target: the transports alone, both unencrypted.
            summary["fabric_vs_tcp"] = figure(fab) / figure(plain)
        if a.repeat > 1:
            # Every repetition's own comparison: wanxfer against the best peer of that
            # repetition, and for (f) its recovery seconds.
            summary["repeats"] = a.repeat
            per_rep = []
            for i in range(a.repeat):
                mine = [r for k, v in reps.items() for r in v[i:i + 1] if "error" not in r]
                wx = next((r for r in mine if r["tool"] == "wanxfer"), None)
                others = [figure(r) for r in mine if r["tool"] not in WANXFER_TOOLS]
                entry = {"rep": i + 1,
                         "wanxfer_vs_best_peer_exact": figure(wx) / max(others) if wx and others else None}
                fab = next((r for r in mine if r["tool"] == "wanxfer-fabric"), None)
                plain = next((r for r in mine if r["tool"] == "wanxfer-plain"), None)
                if fab and plain:
                    entry["fabric_vs_tcp"] = figure(fab) / figure(plain)
                if wx and spec["steps"] and wx.get("progress"):
                    entry["recovery_s"] = [rc["seconds_to_within"] for rc in recovery(path, wx["progress"])]
                if spec["steps"]:
                    # Every other tool's too, run by run: how often the congestion control
                    # alone (iperf3) meets the target on this host, beside wanxfer.
                    entry["peer_recovery_s"] = {
                        r["tool"]: [rc["seconds_to_within"] for rc in recovery(path, r["progress"])]
                        for r in mine if r["tool"] != "wanxfer" and r.get("progress")}
                per_rep.append(entry)
            summary["per_rep"] = per_rep
        summaries.append(summary)
    meta = {"machine": benchlib.machine(), "load": benchlib.loadavg(), "binaries": REL, "scale": a.scale, "repeat": a.repeat, "flags": a.flags,
            "paths": {n: PATHS[n]["what"] for n in a.paths.split(",")}}
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "paths": summaries}, f, indent=1)
    cmdline = "sudo " + (f"WANXFER_BIN_DIR={BIN_DIR} " if BIN_DIR else "") + f"bench/tuning.py --paths {a.paths} --scale {a.scale} --tools {a.tools} --gridftp-p {a.gridftp_p}" \
        + (f" --repeat {a.repeat}" if a.repeat > 1 else "") + (f" --flags='{a.flags}'" if a.flags else "")
    tuned = f"with `{a.flags}`: **a control run, not the target's no-flags run**" if a.flags else "no tuning flags"
    title = (f"wanxfer ({tuned}) against iperf3 and GridFTP" if "wanxfer" in a.tools.split(",")
             else f"wanxfer's transports ({a.tools})")
    lines = [f"# The issue's six paths: {title} through wanxfer-emu", "",
             f"Command: `{cmdline}`", "",
             f"Machine: {meta['machine']}; load {meta['load']}. Transfers are {a.scale:g} x the issue's size "
             f"(20 x BDP; (f): 10 s at each rate)" + (" -- **a smoke run, not the targets' size**" if a.scale < 1 else "")
             + ". Ceiling = rate x 1448/1500 ((f): averaged over the tool's run).", "",
             "Clocks. `Gbit/s` and `seconds` are each tool's own figure: iperf3's data phase (its "
             "connection set-up and result exchange excluded), wanxfer's from its first connect to the "
             "destination's verified commit (set-up included), GridFTP's whole command. `wall` is every "
             "tool's whole command, process start to exit, timed alike. iperf3 `-n N` ends once N bytes "
             "are written, with some still in flight, so its wall brackets it: `delivered / wall` (what its "
             "server counted) and `N / wall`. `exact` is the whole command until the receiver had all N: "
             "wanxfer's and GridFTP's wall, iperf3's from a second run that sent more than N and timed its "
             "server's count reaching N (tuning.py's docstring; evidence in the last table): the "
             "like-for-like figure.", "",
             "| path | tool | streams | Gbit/s | of ceiling | of best | seconds | wall s | by wall: delivered | "
             "N / wall | exact wall s | exact Gbit/s | client CPU s | server CPU s | emu busy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f3 = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"
    for s in summaries:
        for r in (r for r in rows if r["path"] == s["path"]):
            if "error" in r:
                lines.append(f"| {s['path']} | {r['tool']} | failed: {r['error'][:80]} | | | | | | | | | | | | |")
                continue
            tool = r["tool"] + (f" #{r['rep']}" if a.repeat > 1 else "")
            lines.append(f"| {s['path']} | {tool} | {r['streams']} | {r['gbit_per_s']:.3f} | {r['of_ceiling']:.2f} | "
                         f"{r['gbit_per_s'] / s['best_gbit_per_s']:.2f} | {r['seconds']:.1f} | {f3(r.get('wall_s'), 1)} | "
                         f"{f3(r.get('wall_gbit_per_s'), 3)} | {f3(r.get('wall_gbit_per_s_asked'), 3)} | "
                         f"{f3(r.get('exact_wall_s'), 2)} | {f3(r.get('exact_gbit_per_s'), 3)} | {f3(r['client_cpu_s'])} | "
                         f"{f3(r['server_cpu_s'])} | {f3(r['emu']['busy'])} |")
    ratio = lambda s, key: f"{f3(s.get('wanxfer_vs_best_peer_' + key))} ({s.get('best_peer_' + key, '-')})"
    lines += ["", "wanxfer / best peer: by own figures; by the whole command against each peer's exact figure "
              "(**the target's comparison**), against the same with iperf3's set-up and result exchange "
              "timed on the idle path where that is shorter (the reading most favourable to iperf3), and "
              "against iperf3's old bounds (delivered / wall, N / wall).", "",
              "| path | what | bytes | own figures | **exact** | exact, idle set-up and exchange | lower bound | "
              "upper bound | wanxfer of ceiling | emulator carried (Gbit/s) | emulator-bound |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lines.append(f"| {s['path']} | {s['what']} | {s['bytes']} | {f3(s.get('wanxfer_vs_best_peer'))} "
                     f"({s.get('best_peer', '-')}) | **{ratio(s, 'exact')}** | {ratio(s, 'exact_idle')} | "
                     f"{ratio(s, 'wall')} | {ratio(s, 'upper')} | "
                     f"{f3(s.get('wanxfer_of_ceiling'))} | {f3(s['emu_floor_gbit_per_s'], 3)} | "
                     f"{'yes: the figures measure the emulator' if s['emu_bound'] else 'no'} |")
    exact_rows = [r for r in rows if isinstance(r.get("exact"), dict)]
    if exact_rows:
        lines += ["", "iperf3's exact runs. Server clock from its test start (TEST_START sent), 0.1 s intervals; "
                  "client clock from TEST_START received. `first data in`: the interval where data first "
                  "arrived (about one RTT after the server's start). `reached`: when the server's count reached "
                  "N, interpolated within its interval (`in`). `end`: TEST_END's arrival (server) and the last "
                  "write (client); their skew is about RTT plus the queue TEST_END waited in (`skew - RTT`). "
                  "Exact wall = wall - (server end - reached), its range from the interval's ends; it needs no "
                  "offset between the two clocks. `overhead` = wall - server end (set-up to the server's start, "
                  "and result exchange), in this run and in a 1 KiB run on the idle path; exact idle = reached + "
                  "idle overhead.", "",
                  "| path | tool | N | sent | server counted | sum of intervals | first data in s | reached s (in) | "
                  "server end s | client end s | skew s | skew - RTT s | wall s | exact wall s (range) | "
                  "overhead s: run / idle | exact idle wall s | lower <= exact <= upper |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in exact_rows:
            x = r["exact"]
            if "error" in x:
                lines.append(f"| {r['path']} | {r['tool']} | failed: {x['error'][:80]} |" + " |" * 14)
                continue
            n = next(s["bytes"] for s in summaries if s["path"] == r["path"])
            inside = (r.get("wall_gbit_per_s") or 0) <= r["exact_gbit_per_s"] <= (r.get("wall_gbit_per_s_asked") or 0)
            lines.append(f"| {r['path']} | {r['tool']} | {n} | {x['sent_bytes']} | {x['server_bytes']} | "
                         f"{x['server_intervals_bytes']} | {'-'.join(f'{v:.3f}' for v in x['server_first_bytes_in_s'] or [])} | "
                         f"{x['server_reached_s']:.3f} ({x['server_reached_in_s'][0]:.2f}-"
                         f"{x['server_reached_in_s'][1]:.2f}) | {x['server_end_s']:.3f} | {x['client_end_s']:.3f} | "
                         f"{x['end_skew_s']:.3f} | {x['skew_less_rtt_s']:.3f} | {x['wall_s']:.2f} | {x['exact_wall_s']:.2f} "
                         f"({x['exact_wall_range_s'][0]:.2f}-{x['exact_wall_range_s'][1]:.2f}) | "
                         f"{x['overhead_s']:.2f} / {x['idle_overhead_s']:.2f} | {x['exact_idle_wall_s']:.2f} | "
                         f"{'yes' if inside else 'no'} |")
    for s in summaries:
        for rc in s.get("recovery_iperf3_p1", []):
            lines.append("")
            lines.append(f"Path {s['path']}, rate change at {rc['at_s']:g} s, iperf3 -P1 for comparison (the same "
                         f"congestion control with no tuner): within 10% after {f3(rc['seconds_to_within'], 1)} s, "
                         f"staying within it in {f3(rc['share_within_after'])} of the {rc['lines_after']} lines after.")
        for rc in s.get("recovery", []):
            lines.append("")
            lines.append(f"Path {s['path']}, rate change at {rc['at_s']:g} s to {rc['to_gbit_per_s']:g} Gbit/s: wanxfer within 10% "
                         f"of the new ceiling after {f3(rc['seconds_to_within'], 1)} s (target <= 5 s; 1 s progress lines, an "
                         f"upper bound by at most {f3(max(0.0, s['cp_start_after_emu_s'] - 1), 1)} s, the emulator's start-up), staying within "
                         f"it in {f3(rc['share_within_after'])} of the {rc['lines_after']} lines after.")
    for s in summaries:
        if s.get("fabric_vs_tcp"):
            lines += ["", f"Path {s['path']}: wanxfer-fabric / wanxfer-plain (both `--no-encryption`, so only the "
                      f"transport differs), by each one's exact figure: **{s['fabric_vs_tcp']:.2f}** "
                      "(target >= 0.9 on (b) and (d))."]
    for s in summaries:
        if s.get("per_rep"):
            lines += ["", f"Path {s['path']}, each repetition on its own: wanxfer's exact figure against the best "
                      "peer's of the same repetition" + (", and its seconds to within 10% after each rate change"
                                                         if any("recovery_s" in e for e in s["per_rep"]) else "")
                      + ". The tables above show each tool's median run.", "",
                      "| repetition | wanxfer / best peer, exact | fabric / TCP, unencrypted | recovery s | peers' recovery s |",
                      "|---|---|---|---|---|"]
            for e in s["per_rep"]:
                rec = ", ".join(f3(v, 1) for v in e.get("recovery_s", [])) or "-"
                peers_rec = "; ".join(f"{tool} {', '.join(f3(v, 1) for v in secs)}"
                                      for tool, secs in e.get("peer_recovery_s", {}).items()) or "-"
                lines.append(f"| {e['rep']} | {f3(e['wanxfer_vs_best_peer_exact'])} | {f3(e.get('fabric_vs_tcp'))} "
                             f"| {rec} | {peers_rec} |")
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--rtts", default="50,100")
    ap.add_argument("--bytes", default="2GiB", help="per run; at least 20 x BDP for the issue's targets")
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--hand", default="--streams 8", help="the hand-tuned wanxfer flags")
    ap.add_argument("--parallel", default="1,4,8", help="iperf3 -P values; the best counts")
    ap.add_argument("--paths", help="the issue's paths to run, e.g. a,b,c,d,e,f (then --rate/--rtts/--loss/--hand "
                    "do not apply): wanxfer with no tuning flags against --tools in one run")
    ap.add_argument("--scale", type=float, default=1.0, help="with --paths: transfer size as a share of 20 x BDP "
                    "(below 1 only for smoke runs; the output says so)")
    ap.add_argument("--tools", default="wanxfer,iperf3-P1,iperf3-P4,gridftp", help="with --paths")
    ap.add_argument("--gridftp-p", type=int, default=4, help="with --paths: globus-url-copy -p (-tcp-bs is "
                    "2 x BDP / p, at least 1 MiB)")
    ap.add_argument("--repeat", type=int, default=1, help="with --paths: runs of every tool per path, "
                    "interleaved; each tool's median run stands for it in the summary")
    ap.add_argument("--flags", default="", help="with --paths: extra `wanxfer cp` flags (a control run, e.g. "
                    "--streams 2: then it is not the target's no-flags run, and the output says so)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.out = a.out or os.path.join(ROOT, "bench", "runs", "paths" if a.paths else "tuning")
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces)")
    if not BIN_DIR:
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "wanxfer", "-p", "wanxfer-emu"],
                       cwd=ROOT, check=True)
    if a.paths:
        if a.repeat < 1:
            sys.exit("--repeat: at least 1")
        return run_paths(a)
    size = benchlib.parse_size(a.bytes)
    ceiling = rate_bps(a.rate) * 1448 / 1500 / 1e9
    rows = []
    for rtt in [float(r) for r in a.rtts.split(",")]:
        path = path_of(rtt, a.rate, a.loss)
        runs = {"wanxfer tuned": wanxfer(path, size, "")}
        runs[f"wanxfer {a.hand}"] = wanxfer(path, size, a.hand)
        iperfs = [iperf3(path, size, int(p)) for p in a.parallel.split(",")]
        for p, r in zip(a.parallel.split(","), iperfs):
            runs[f"iperf3 -P{p}"] = r
        for name, r in runs.items():
            r.update(tool=name, rtt_ms=rtt, ratio=r["gbit_per_s"] / ceiling)
            rows.append(r)
            print(json.dumps(r), flush=True)
        best_iperf = max(iperfs, key=lambda r: r["gbit_per_s"])
        for r in runs.values():
            # N / wall: exact for wanxfer, iperf3's upper bound; its exact figure is from
            # its second run (module docstring), and is what the summary compares.
            r["wall_gbit_per_s"] = size * 8 / r["wall_s"] / 1e9 if r.get("wall_s") else None
            x = r.get("exact") or {"exact_wall_s": r.get("wall_s")}
            r["exact_gbit_per_s"] = size * 8 / x["exact_wall_s"] / 1e9 if x.get("exact_wall_s") else None
        best_wall = max((r["exact_gbit_per_s"] or 0) for r in iperfs) if all(r["exact_gbit_per_s"] for r in iperfs) else 0
        rows.append({"tool": "summary", "rtt_ms": rtt,
                     "tuned_vs_best_iperf3": runs["wanxfer tuned"]["gbit_per_s"] / best_iperf["gbit_per_s"],
                     "tuned_vs_best_iperf3_wall": (runs["wanxfer tuned"]["exact_gbit_per_s"] or 0) / best_wall
                     if best_wall else None,
                     "tuned_vs_hand": runs["wanxfer tuned"]["gbit_per_s"] / runs[f"wanxfer {a.hand}"]["gbit_per_s"]})
    meta = {"machine": benchlib.machine(), "load": benchlib.loadavg(), "rate": a.rate,
            "binaries": REL,
            "loss": a.loss, "bytes": size, "ceiling_gbit_per_s": ceiling}
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# Tuned defaults against iperf3 and hand-tuned flags through wanxfer-emu ({a.rate}, loss {a.loss})", "",
             f"Command: `sudo bench/tuning.py --rate {a.rate} --rtts {a.rtts} --bytes {a.bytes} --loss {a.loss}`", "",
             f"Machine: {meta['machine']}; load {meta['load']}. Ceiling {ceiling:.3f} Gbit/s (rate x 1448/1500).", "",
             "`Gbit/s` and `seconds`: each tool's own figure (iperf3's data phase; wanxfer's from its first "
             "connect, set-up included). `wall`: the whole command for every tool, timed alike; iperf3 "
             "`-n N` ends with bytes in flight, so N / wall is its upper bound and `exact` (its whole "
             "command until its server had N, from a longer run: tuning.py's docstring) the comparison.", "",
             "| RTT ms | tool | streams | Gbit/s | of ceiling | seconds | wall s | N / wall | exact Gbit/s | client CPU s | server CPU s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    f3 = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"
    for r in rows:
        if r["tool"] == "summary":
            lines.append(f"| {r['rtt_ms']:g} | **tuned / best iperf3 {r['tuned_vs_best_iperf3']:.2f} "
                         f"(by exact wall {f3(r['tuned_vs_best_iperf3_wall'])}), "
                         f"tuned / hand {r['tuned_vs_hand']:.2f}** | | | | | | | | | |")
            continue
        lines.append(f"| {r['rtt_ms']:g} | {r['tool']} | {r['streams']} | {r['gbit_per_s']:.3f} | {r['ratio']:.2f} | "
                     f"{r['seconds']:.1f} | {f3(r.get('wall_s'), 1)} | {f3(r.get('wall_gbit_per_s'), 3)} | "
                     f"{f3(r.get('exact_gbit_per_s'), 3)} | "
                     f"{r['client_cpu_s']:.2f} | {r['server_cpu_s']:.2f} |")
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
