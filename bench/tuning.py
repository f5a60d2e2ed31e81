#!/usr/bin/env python3
"""Issue 19: wanxfer with no tuning flags against iperf3 (-P 1/4/8, best) and wanxfer with
hand-chosen flags, memory to memory through wanxfer-emu, at 50 and 100 ms.

Each figure is a ratio to the emulator's goodput ceiling (rate x 1448/1500: what TCP
payload can reach through a bottleneck of that rate), with CPU seconds per side: for
wanxfer its own --json (this process and the server's session threads), for iperf3 its
-J cpu_utilization_percent times the test's seconds. One emulator per run, so its own
counters (bytes out, drops) belong to that run alone and are kept in OUT.json.

usage: sudo bench/tuning.py [--rate 1gbit] [--rtts 50,100] [--bytes 2GiB] [--loss 0.0001]
                            [--hand "--streams 8"] [--out bench/runs/tuning]   (root)
Writes OUT.json and OUT.md. Smoke run: --bytes 64MiB --rtts 50 (then the figures mostly
measure slow start: say so when quoting them).
"""
import argparse
import json
import os
import shlex
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# WANXFER_BIN_DIR: binaries built elsewhere (then nothing is built).
BIN_DIR = os.environ.get("WANXFER_BIN_DIR")
REL = BIN_DIR or os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release")
RIGHT = "10.77.0.2"
SECRET = "tuning-bench-0123456789abcdef"
OUT_FILE = "/tmp/wanxfer-tuning-bench.json"


def rate_bps(text):
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, m in units.items():
        if text.endswith(u):
            return float(text[: -len(u)]) * m
    return float(text)


def emulate(rtt_ms, rate, loss, right, left):
    """Runs `left` against `right` through a fresh emulated path; returns the left
    command's output (written to OUT_FILE) and the emulator's report."""
    bps = rate_bps(rate)
    bdp = int(bps * rtt_ms / 1e3 / 8)
    if os.path.exists(OUT_FILE):
        os.unlink(OUT_FILE)
    cmd = [
        f"{REL}/wanxfer-emu", "--cpu", "1", "--rtt", f"{rtt_ms}ms", "--rate", rate,
        "--buffer", str(max(1_000_000, bdp)), "--tcp-mem", str(max(64 << 20, 4 * bdp)),
        "--loss", str(loss), "--settle", "1",
        "--right", right,
        "--left", f"taskset -c 0 sh -c {shlex.quote(left + ' > ' + OUT_FILE)}",
    ]
    env = dict(os.environ, WANXFER_SECRET=SECRET, WANXFER_STATE_DIR="/tmp/wanxfer-tuning-bench-state")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    text = p.stdout
    report = json.loads(text[text.index("{"):]) if "{" in text else {}
    try:
        with open(OUT_FILE) as f:
            out = f.read()
    except OSError:
        out = ""
    return out, report, p.stderr


def wanxfer(rtt_ms, rate, loss, size, flags):
    right = f"{REL}/wanxfer serve --root /tmp --listen {RIGHT}:7800 >/dev/null 2>&1"
    left = (f"{REL}/wanxfer cp --json --quiet {flags} --bytes {size} /dev/zero "
            f"wanxfer://{RIGHT}:7800/dev/null")
    out, report, err = emulate(rtt_ms, rate, loss, right, left)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        raise benchlib.ToolError(f"wanxfer {flags}: no result: {err[-500:]}")
    r = json.loads(lines[-1])
    tuning = r.get("tuning") or {}
    return {
        "gbit_per_s": r["gbit_per_s"],
        "seconds": r["seconds"],
        "client_cpu_s": r["cpu_user_s"] + r["cpu_sys_s"],
        "server_cpu_s": r["peer_cpu_user_s"] + r["peer_cpu_sys_s"],
        "streams": r["streams"],
        "channels": len(r.get("channels") or []),
        "decisions": tuning.get("decisions"),
        "min_rtt_ms": tuning.get("min_rtt_ms"),
        "emu": {k: report.get("forward", {}).get(k) for k in ("bytes_out", "dropped_queue", "dropped_loss")},
    }


def iperf3(rtt_ms, rate, loss, size, parallel):
    right = "iperf3 -s -1 >/dev/null 2>&1"
    left = f"iperf3 -c {RIGHT} -J -P {parallel} -n {size}"
    out, report, err = emulate(rtt_ms, rate, loss, right, left)
    try:
        r = json.loads(out)
        end = r["end"]
        seconds = end["sum_received"]["seconds"]
        cpu = end["cpu_utilization_percent"]
    except (ValueError, KeyError) as e:
        raise benchlib.ToolError(f"iperf3 -P {parallel}: {e}: {out[-300:]} {err[-300:]}")
    return {
        "gbit_per_s": end["sum_received"]["bits_per_second"] / 1e9,
        "seconds": seconds,
        "client_cpu_s": cpu["host_total"] / 100 * seconds,
        "server_cpu_s": cpu["remote_total"] / 100 * seconds,
        "streams": parallel,
        "emu": {k: report.get("forward", {}).get(k) for k in ("bytes_out", "dropped_queue", "dropped_loss")},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--rtts", default="50,100")
    ap.add_argument("--bytes", default="2GiB", help="per run; at least 20 x BDP for the issue's targets")
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--hand", default="--streams 8", help="the hand-tuned wanxfer flags")
    ap.add_argument("--parallel", default="1,4,8", help="iperf3 -P values; the best counts")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "runs", "tuning"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces)")
    if not BIN_DIR:
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "wanxfer", "-p", "wanxfer-emu"],
                       cwd=ROOT, check=True)
    size = benchlib.parse_size(a.bytes)
    ceiling = rate_bps(a.rate) * 1448 / 1500 / 1e9
    rows = []
    for rtt in [float(r) for r in a.rtts.split(",")]:
        runs = {"wanxfer tuned": wanxfer(rtt, a.rate, a.loss, size, "")}
        runs[f"wanxfer {a.hand}"] = wanxfer(rtt, a.rate, a.loss, size, a.hand)
        iperfs = [iperf3(rtt, a.rate, a.loss, size, int(p)) for p in a.parallel.split(",")]
        for p, r in zip(a.parallel.split(","), iperfs):
            runs[f"iperf3 -P{p}"] = r
        for name, r in runs.items():
            r.update(tool=name, rtt_ms=rtt, ratio=r["gbit_per_s"] / ceiling)
            rows.append(r)
            print(json.dumps(r), flush=True)
        best_iperf = max(iperfs, key=lambda r: r["gbit_per_s"])
        rows.append({"tool": "summary", "rtt_ms": rtt,
                     "tuned_vs_best_iperf3": runs["wanxfer tuned"]["gbit_per_s"] / best_iperf["gbit_per_s"],
                     "tuned_vs_hand": runs["wanxfer tuned"]["gbit_per_s"] / runs[f"wanxfer {a.hand}"]["gbit_per_s"]})
    meta = {"machine": benchlib.machine(), "load": benchlib.loadavg(), "rate": a.rate,
            "binaries": REL,
            "loss": a.loss, "bytes": size, "ceiling_gbit_per_s": ceiling}
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# Tuned defaults against iperf3 and hand-tuned flags through wanxfer-emu ({a.rate}, loss {a.loss})", "",
             f"Command: `sudo bench/tuning.py --rate {a.rate} --rtts {a.rtts} --bytes {a.bytes} --loss {a.loss}`", "",
             f"Machine: {meta['machine']}; load {meta['load']}. Ceiling {ceiling:.3f} Gbit/s (rate x 1448/1500).", "",
             "| RTT ms | tool | streams | Gbit/s | of ceiling | seconds | client CPU s | server CPU s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["tool"] == "summary":
            lines.append(f"| {r['rtt_ms']:g} | **tuned / best iperf3 {r['tuned_vs_best_iperf3']:.2f}, "
                         f"tuned / hand {r['tuned_vs_hand']:.2f}** | | | | | | |")
            continue
        lines.append(f"| {r['rtt_ms']:g} | {r['tool']} | {r['streams']} | {r['gbit_per_s']:.3f} | {r['ratio']:.2f} | "
                     f"{r['seconds']:.1f} | {r['client_cpu_s']:.2f} | {r['server_cpu_s']:.2f} |")
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
