#!/usr/bin/env python3
"""kissel2013 Figures 2(a)/3(a), and with --buffer 1MB 2(b)/3(b) and 3(c), with wanxfer
through wanxfer-emu: memory-to-memory throughput of one stream against the bytes it may
have in flight, at a short (~0.2 ms) and a long (95 ms) RTT, on a bottleneck the emulator
sustains.

2(b)/3(b) are the shallow policer: a drop-tail buffer (1 MB, the XGEM's) far below the
95 ms path's BDP, so a sender bursting more than the buffer into it loses frames. 3(c) is
the same with the sender paced (--rate-limit, passed to `wanxfer cp --rate`: the kernel's
pacing on TCP, a token bucket on fabric), which kissel2013 shows reaching the bottleneck
rate once enough is in flight; the model is then min(pace, rate, in flight / RTT).

Over the fabric transport the bytes in flight are exactly what the receiver granted:
(depth + 1) slots of one block each, so the curve should follow
min(rate, in_flight / RTT). Over TCP the kernel's window (autotuned up to tcp_wmem) sets
what is in flight, whatever block size and depth say; it is plotted for comparison.

usage: sudo bench/wan_inflight.py [--rate 1gbit] [--rtts 0.2,95] [--transports fabric,tcp]
          [--buffer BYTES] [--rate-limit none,900M] [--blocks 65536,...] [--depths 1,3,7,15]
          [--seconds 3] [--out bench/runs/wan-inflight]   (root)
Writes OUT.json, OUT.svg and OUT.md. kissel2013 2(b)/3(b)/3(c):
  sudo bench/wan_inflight.py --buffer 1000000 --rate-limit none,900M --out bench/runs/wan-policer
"""
import argparse
import json
import os
import shlex
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
import tuning  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REL = tuning.REL
rate_bps = tuning.rate_bps
BLOCKS = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
DEPTHS = [1, 3, 7, 15]  # slots = depth + 1: 2, 4, 8, 16


def sweep(rtt_ms, rate, transport, seconds, buffer=None, pace=None):
    """One emulator instance, one server on the right, every point from the left."""
    bps = rate_bps(rate)
    top = min(bps, pace) if pace else bps
    runs = []
    for block in BLOCKS:
        for depth in DEPTHS:
            depth = max(depth, 1)
            slots = depth + 1
            inflight = block * slots
            expected = min(top, inflight * 8 / (rtt_ms / 1e3))
            size = int(min(max(expected / 8 * seconds, 8 << 20), 2 << 30))
            runs.append((block, depth, inflight, size))
    pacing = f"--rate {pace} " if pace else ""
    # The fabric transport writes into the peer's memory, where TLS cannot reach: wanxfer
    # refuses it without --no-encryption (each block still carries a MAC); TCP keeps TLS.
    plain = "--no-encryption " if transport == "fabric" else ""
    # A point that stalls (a policer dropping a burst's tail) must not stop the sweep:
    # each cp has its own bound, and one that fails still prints a line.
    # Each point's 1 s progress lines: its rate once data flows, without the set-up round
    # trips and the fabric connect that a few-second point would otherwise be divided by.
    lines = [f"/tmp/wanxfer-inflight-{os.getpid()}-{i}.jsonl" for i in range(len(runs))]
    for f in lines:
        if os.path.exists(f):
            os.unlink(f)
    script = " ; ".join(
        f"timeout {int(4 * seconds + 60)} {REL}/wanxfer cp --json --quiet --progress-json={f} --transport {transport} "
        f"--streams 1 --block-size {b} --depth {d} {plain}{pacing}--bytes {n} /dev/zero "
        f"wanxfer://10.77.0.2:7800/dev/null; echo RC $?"
        for (b, d, _, n), f in zip(runs, lines)
    )
    right = f"{REL}/wanxfer serve --root /tmp --listen 10.77.0.2:7800 --transport fabric --allow-unencrypted >/dev/null 2>&1"
    timeout = len(runs) * (4 * seconds + 70) + 60
    out, _, err = tuning.emulate(rtt_ms, rate, 0.0, right, script, buffer=buffer, timeout=timeout)
    # Each point ends with "RC <exit code>"; its result is the JSON line before, if it exited 0.
    results, last = [], None
    for line in out.splitlines():
        if line.startswith("{"):
            last = json.loads(line)
        elif line.startswith("RC "):
            results.append(last if line.split()[1] == "0" and last else None)
            last = None
    if len(results) != len(runs):
        raise benchlib.ToolError(f"{transport} at {rtt_ms} ms: {len(results)} results of {len(runs)}: {err[-300:]}")
    points = []
    for (block, depth, inflight, _), r, f in zip(runs, results, lines):
        flowing = data_phase(f)
        points.append({"transport": transport, "rtt_ms": rtt_ms, "block": block, "depth": depth,
                       "pace_bits_per_s": pace, "buffer": buffer, "in_flight": inflight,
                       # The data phase where the progress lines span one; else the whole run.
                       "gbit_per_s": (flowing if flowing is not None else r["gbit_per_s"]) if r else 0.0,
                       "data_phase": flowing is not None,
                       "whole_run_gbit_per_s": r["gbit_per_s"] if r else 0.0, "failed": r is None,
                       "model_gbit_per_s": min(top, inflight * 8 / (rtt_ms / 1e3)) / 1e9})
        print(points[-1], flush=True)
    return points


def data_phase(path):
    """Gbit/s between the first progress line that counts bytes and the last line, or
    None where fewer than two lines do."""
    try:
        with open(path) as fh:
            lines = [json.loads(line) for line in fh if line.startswith("{")]
        os.unlink(path)
    except (OSError, ValueError):
        return None
    moving = [p for p in lines if p.get("event") == "progress" and p.get("bytes", 0) > 0]
    if len(moving) < 2 or moving[-1]["t_s"] <= moving[0]["t_s"]:
        return None
    return (moving[-1]["bytes"] - moving[0]["bytes"]) * 8 / (moving[-1]["t_s"] - moving[0]["t_s"]) / 1e9


def svg(points, rtts, rate, path):
    """A log-log plot per RTT: measured Gbit/s against bytes in flight, and the model."""
    import math
    w, h, pad = 520, 340, 60
    panels = []
    for i, rtt in enumerate(rtts):
        ox = i * (w + 20)
        pts = [p for p in points if p["rtt_ms"] == rtt]
        xs = [p["in_flight"] for p in pts]
        x0, x1 = math.log10(min(xs)), math.log10(max(xs))
        y1 = math.log10(max(rate_bps(rate) / 1e9 * 1.5, max(p["gbit_per_s"] for p in pts)))
        y0 = math.log10(max(min(min(p["gbit_per_s"] for p in pts), min(p["model_gbit_per_s"] for p in pts)) / 1.5, 1e-3))
        X = lambda v: ox + pad + (math.log10(v) - x0) / (x1 - x0 or 1) * (w - 2 * pad)
        Y = lambda v: h - pad - (math.log10(max(v, 1e-9)) - y0) / (y1 - y0 or 1) * (h - 2 * pad)
        buf = pts[0].get("buffer")
        g = [f'<text x="{ox + w / 2}" y="20" text-anchor="middle" font-size="14">RTT {rtt} ms, bottleneck {rate}'
             f'{f", {buf / 1e6:g} MB buffer" if buf else ""}</text>',
             f'<line x1="{ox + pad}" y1="{h - pad}" x2="{ox + w - pad}" y2="{h - pad}" stroke="black"/>',
             f'<line x1="{ox + pad}" y1="{pad}" x2="{ox + pad}" y2="{h - pad}" stroke="black"/>',
             f'<text x="{ox + w / 2}" y="{h - 15}" text-anchor="middle" font-size="12">bytes in flight (log)</text>',
             f'<text x="{ox + 15}" y="{h / 2}" font-size="12" transform="rotate(-90 {ox + 15} {h / 2})" text-anchor="middle">Gbit/s (log)</text>']
        model = sorted(pts, key=lambda p: p["in_flight"])
        g.append('<polyline fill="none" stroke="gray" stroke-dasharray="4 3" points="' +
                 " ".join(f"{X(p['in_flight']):.1f},{Y(p['model_gbit_per_s']):.1f}" for p in model) + '"/>')
        paced = sorted((p for p in pts if p.get("pace_bits_per_s")), key=lambda p: p["in_flight"])
        if paced:
            g.append('<polyline fill="none" stroke="gray" stroke-dasharray="1 3" points="' +
                     " ".join(f"{X(p['in_flight']):.1f},{Y(p['model_gbit_per_s']):.1f}" for p in paced) + '"/>')
        colors = {"fabric": "#c0392b", "tcp": "#2471a3"}
        for p in pts:
            # Filled: unpaced; hollow: paced (--rate-limit); a failed point sits on the floor.
            fill = "none" if p.get("pace_bits_per_s") else colors[p["transport"]]
            g.append(f'<circle cx="{X(p["in_flight"]):.1f}" cy="{Y(max(p["gbit_per_s"], 10 ** y0)):.1f}" r="3.5" '
                     f'fill="{fill}" stroke="{colors[p["transport"]]}"/>')
        for k, v in enumerate([1e5, 1e6, 1e7, 1e8]):
            if x0 <= math.log10(v) <= x1:
                g.append(f'<text x="{X(v):.1f}" y="{h - pad + 15}" font-size="10" text-anchor="middle">{v:.0e}</text>')
        for v in [0.001, 0.01, 0.1, 1, 10]:
            if y0 <= math.log10(v) <= y1:
                g.append(f'<text x="{ox + pad - 5}" y="{Y(v) + 3:.1f}" font-size="10" text-anchor="end">{v:g}</text>')
        panels += g
    legend = ('<text x="70" y="40" font-size="11" fill="#c0392b">● fabric (credits = slots)</text>'
              '<text x="70" y="54" font-size="11" fill="#2471a3">● tcp (window autotuned)</text>'
              '<text x="70" y="68" font-size="11" fill="gray">- - min(rate, in flight / RTT); filled unpaced</text>'
              '<text x="70" y="82" font-size="11" fill="gray">. . min(pace, rate, in flight / RTT); hollow paced</text>')
    body = "\n".join(panels) + legend
    total_w = len(rtts) * (w + 20)
    with open(path, "w") as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{h}" font-family="sans-serif">'
                f'<rect width="100%" height="100%" fill="white"/>{body}</svg>\n')


def main():
    global BLOCKS, DEPTHS
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--rtts", default="0.2,95")
    ap.add_argument("--seconds", type=float, default=3.0, help="target duration per point")
    ap.add_argument("--transports", default="fabric,tcp")
    ap.add_argument("--buffer", type=int, default=None,
                    help="bottleneck drop-tail buffer in bytes (default: the BDP, at least 1 MB); "
                         "1000000 for kissel2013's policer, Fig. 2(b)/3(b)")
    ap.add_argument("--rate-limit", default="none",
                    help="comma list of wanxfer cp --rate values (decimal bits/s: 900M), 'none' for unpaced; "
                         "kissel2013 Fig. 3(c) is the paced series")
    ap.add_argument("--blocks", default=",".join(map(str, BLOCKS)), help="block sizes in bytes")
    ap.add_argument("--depths", default=",".join(map(str, DEPTHS)), help="depths (slots = depth + 1)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "runs", "wan-inflight"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces)")
    BLOCKS = [int(b) for b in a.blocks.split(",")]
    DEPTHS = [int(d) for d in a.depths.split(",")]
    paces = [None if v == "none" else int(rate_bps(v.lower().replace("g", "gbit").replace("m", "mbit")))
             for v in a.rate_limit.split(",")]
    if not tuning.BIN_DIR:
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "wanxfer", "-p", "wanxfer-emu"], cwd=ROOT, check=True)
    rtts = [float(r) for r in a.rtts.split(",")]
    points = []
    for transport in a.transports.split(","):
        for rtt in rtts:
            for pace in paces:
                try:
                    points += sweep(rtt, a.rate, transport, a.seconds, a.buffer, pace)
                except benchlib.ToolError as e:
                    sys.exit(f"wan_inflight: {e}")
    meta = {"machine": benchlib.machine(), "load": benchlib.loadavg(), "rate": a.rate, "buffer": a.buffer,
            "rate_limit": a.rate_limit}
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "points": points}, f, indent=1)
    svg(points, rtts, a.rate, a.out + ".svg")
    cmdline = (f"sudo bench/wan_inflight.py --rate {a.rate} --rtts {a.rtts} --seconds {a.seconds} "
               f"--transports {a.transports} --rate-limit {a.rate_limit} --blocks {a.blocks} --depths {a.depths}"
               + (f" --buffer {a.buffer}" if a.buffer else ""))
    lines = [f"# Throughput against bytes in flight through wanxfer-emu ({a.rate}"
             + (f", {a.buffer} B drop-tail buffer" if a.buffer else "") + ")", "",
             f"Command: `{cmdline}`", "", f"Machine: {meta['machine']}; load {meta['load']}.", "",
             "`Gbit/s` is the data phase: from the first 1 s progress line that counts bytes to the last "
             "(marked * where a point had fewer than two such lines, and the whole run is used); `whole run` "
             "divides by everything from the first connect, set-up round trips included.", "",
             "| transport | RTT ms | paced | block | slots | in flight | Gbit/s | whole run | model Gbit/s | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        pace = f"{p['pace_bits_per_s'] / 1e6:g} Mbit/s" if p["pace_bits_per_s"] else "no"
        got = "failed" if p["failed"] else f"{p['gbit_per_s']:.3f}" + ("" if p.get("data_phase") else "*")
        lines.append(f"| {p['transport']} | {p['rtt_ms']} | {pace} | {p['block'] >> 10} KiB | {p['depth'] + 1} | "
                     f"{p['in_flight'] >> 10} KiB | {got} | {p.get('whole_run_gbit_per_s', 0):.3f} | "
                     f"{p['model_gbit_per_s']:.3f} | {p['gbit_per_s'] / p['model_gbit_per_s']:.2f} |")
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
