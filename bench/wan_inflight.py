#!/usr/bin/env python3
"""kissel2013 Figures 2(a) and 3(a) with wanxfer through wanxfer-emu: memory-to-memory
throughput of one stream against the bytes it may have in flight, at a short (~0.2 ms)
and a long (95 ms) RTT, on a bottleneck the emulator sustains.

Over the fabric transport the bytes in flight are exactly what the receiver granted:
(depth + 1) slots of one block each, so the curve should follow
min(rate, in_flight / RTT). Over TCP the kernel's window (autotuned up to tcp_wmem) sets
what is in flight, whatever block size and depth say; it is plotted for comparison.

usage: sudo bench/wan_inflight.py [--rate 1gbit] [--out bench/runs/wan-inflight]   (root)
Writes OUT.json, OUT.svg and OUT.md.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REL = os.path.join(ROOT, "target", "release")
BLOCKS = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
DEPTHS = [1, 3, 7, 15]  # slots = depth + 1: 2, 4, 8, 16


def rate_bps(text):
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, m in units.items():
        if text.endswith(u):
            return float(text[: -len(u)]) * m
    return float(text)


def sweep(rtt_ms, rate, transport, seconds):
    """One emulator instance, one server on the right, every point from the left."""
    bps = rate_bps(rate)
    runs = []
    for block in BLOCKS:
        for depth in DEPTHS:
            depth = max(depth, 1)
            slots = depth + 1
            inflight = block * slots
            expected = min(bps, inflight * 8 / (rtt_ms / 1e3))
            size = int(min(max(expected / 8 * seconds, 8 << 20), 2 << 30))
            runs.append((block, depth, inflight, size))
    script = " ; ".join(
        f"{REL}/wanxfer cp --json --quiet --transport {transport} --streams 1 "
        f"--block-size {b} --depth {d} --bytes {n} /dev/zero wanxfer://10.77.0.2:7800/dev/null"
        for b, d, _, n in runs
    )
    bdp = int(bps * rtt_ms / 1e3 / 8)
    cmd = [
        f"{REL}/wanxfer-emu", "--cpu", "1", "--rtt", f"{rtt_ms}ms", "--rate", rate,
        "--buffer", str(max(1_000_000, bdp)), "--tcp-mem", str(max(64 << 20, 4 * bdp)),
        "--right", f"{REL}/wanxfer serve --root /tmp --listen 10.77.0.2:7800 --transport fabric >/dev/null 2>&1",
        "--left", f"taskset -c 0 sh -c {shlex.quote(script)}",
    ]
    env = dict(os.environ, WANXFER_SECRET="inflight-bench-0123456789abcdef")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600).stdout
    results = [json.loads(l) for l in out.splitlines() if l.startswith('{"bytes"')]
    points = []
    for (block, depth, inflight, _), r in zip(runs, results):
        points.append({"transport": transport, "rtt_ms": rtt_ms, "block": block, "depth": depth,
                       "in_flight": inflight, "gbit_per_s": r["gbit_per_s"],
                       "model_gbit_per_s": min(bps, inflight * 8 / (rtt_ms / 1e3)) / 1e9})
        print(points[-1], flush=True)
    return points


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
        y0 = math.log10(max(min(min(p["gbit_per_s"] for p in pts), min(p["model_gbit_per_s"] for p in pts)) / 1.5, 1e-4))
        X = lambda v: ox + pad + (math.log10(v) - x0) / (x1 - x0 or 1) * (w - 2 * pad)
        Y = lambda v: h - pad - (math.log10(max(v, 1e-9)) - y0) / (y1 - y0 or 1) * (h - 2 * pad)
        g = [f'<text x="{ox + w / 2}" y="20" text-anchor="middle" font-size="14">RTT {rtt} ms, bottleneck {rate}</text>',
             f'<line x1="{ox + pad}" y1="{h - pad}" x2="{ox + w - pad}" y2="{h - pad}" stroke="black"/>',
             f'<line x1="{ox + pad}" y1="{pad}" x2="{ox + pad}" y2="{h - pad}" stroke="black"/>',
             f'<text x="{ox + w / 2}" y="{h - 15}" text-anchor="middle" font-size="12">bytes in flight (log)</text>',
             f'<text x="{ox + 15}" y="{h / 2}" font-size="12" transform="rotate(-90 {ox + 15} {h / 2})" text-anchor="middle">Gbit/s (log)</text>']
        model = sorted(pts, key=lambda p: p["in_flight"])
        g.append('<polyline fill="none" stroke="gray" stroke-dasharray="4 3" points="' +
                 " ".join(f"{X(p['in_flight']):.1f},{Y(p['model_gbit_per_s']):.1f}" for p in model) + '"/>')
        colors = {"fabric": "#c0392b", "tcp": "#2471a3"}
        for p in pts:
            g.append(f'<circle cx="{X(p["in_flight"]):.1f}" cy="{Y(p["gbit_per_s"]):.1f}" r="3.5" fill="{colors[p["transport"]]}"/>')
        for k, v in enumerate([1e5, 1e6, 1e7, 1e8]):
            if x0 <= math.log10(v) <= x1:
                g.append(f'<text x="{X(v):.1f}" y="{h - pad + 15}" font-size="10" text-anchor="middle">{v:.0e}</text>')
        for v in [0.001, 0.01, 0.1, 1, 10]:
            if y0 <= math.log10(v) <= y1:
                g.append(f'<text x="{ox + pad - 5}" y="{Y(v) + 3:.1f}" font-size="10" text-anchor="end">{v:g}</text>')
        panels += g
    legend = ('<text x="70" y="40" font-size="11" fill="#c0392b">● fabric (credits = slots)</text>'
              '<text x="70" y="54" font-size="11" fill="#2471a3">● tcp (window autotuned)</text>'
              '<text x="70" y="68" font-size="11" fill="gray">- - min(rate, in flight / RTT)</text>')
    body = "\n".join(panels) + legend
    total_w = len(rtts) * (w + 20)
    with open(path, "w") as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{h}" font-family="sans-serif">'
                f'<rect width="100%" height="100%" fill="white"/>{body}</svg>\n')


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--rtts", default="0.2,95")
    ap.add_argument("--seconds", type=float, default=3.0, help="target duration per point")
    ap.add_argument("--transports", default="fabric,tcp")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "runs", "wan-inflight"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces)")
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "wanxfer", "-p", "wanxfer-emu"], cwd=ROOT, check=True)
    rtts = [float(r) for r in a.rtts.split(",")]
    points = []
    for transport in a.transports.split(","):
        for rtt in rtts:
            points += sweep(rtt, a.rate, transport, a.seconds)
    with open(a.out + ".json", "w") as f:
        json.dump(points, f, indent=1)
    svg(points, rtts, a.rate, a.out + ".svg")
    lines = [f"# Throughput against bytes in flight through wanxfer-emu ({a.rate})", "",
             f"Command: `sudo bench/wan_inflight.py --rate {a.rate} --rtts {a.rtts} --seconds {a.seconds}`", "",
             "| transport | RTT ms | block | slots | in flight | Gbit/s | model Gbit/s | ratio |", "|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['transport']} | {p['rtt_ms']} | {p['block'] >> 10} KiB | {p['depth'] + 1} | {p['in_flight'] >> 10} KiB | "
                     f"{p['gbit_per_s']:.3f} | {p['model_gbit_per_s']:.3f} | {p['gbit_per_s'] / p['model_gbit_per_s']:.2f} |")
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
