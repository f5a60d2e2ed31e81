#!/usr/bin/env python3
"""Issue 19's fairness target: two wanxfer transfers with no tuning flags, the second
started --gap seconds after the first, through one wanxfer-emu bottleneck (the issue's
paths (a) and (b), as bench/tuning.py defines them). Each transfer's rate over time comes
from its own --progress-json lines (1 s averages of what its data sockets delivered,
`network_bits_per_s`; the block count `bits_per_s` where there is none); the share of each is its mean rate
over [second start + --after, + --window] divided by the two rates' sum (target: each
within 20% of an equal share, 0.4 to 0.6), and against half the goodput ceiling.

Why two clients in one left namespace and one server: that is two independent sessions
sharing one bottleneck, as two users' transfers would; each tunes its own streams.

usage: sudo bench/fairness.py [--paths a,b] [--gap 10] [--after 30] [--window 10]
                              [--out bench/runs/fairness]   (root)
Writes OUT.json, OUT.md and OUT.svg. Smoke run: --gap 3 --after 5 --window 5 (say so).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
import tuning  # noqa: E402

ROOT = tuning.ROOT
RIGHT = tuning.RIGHT
COLORS = ["#2471a3", "#c0392b"]


def run(name, gap, after, window, timeout, flags=""):
    spec = tuning.PATHS[name]
    bps = tuning.rate_bps(spec["rate"])
    bdp = int(bps * spec["rtt_ms"] / 1e3 / 8)
    path = dict(spec, buffer=max(1_000_000, bdp) if spec["buffer"] == "bdp" else spec["buffer"])
    # More than either could move at the path's whole rate, so that neither finishes
    # inside the window whatever share it takes; both are interrupted once the window
    # has closed (the shares come from their progress lines, not their totals).
    tail = after + window + 3
    # Not the same size: two identical requests are one transfer to the server, whose
    # second session would take over from the first (that is how a rerun resumes).
    sizes = [int(bps / 8 * (gap + tail) * 1.5) + i * (1 << 20) for i in (0, 1)]
    files = [f"/tmp/wanxfer-fairness-{os.getpid()}-{i}.jsonl" for i in (1, 2)]
    for f in files + [f + ".out" for f in files]:
        if os.path.exists(f):
            os.unlink(f)

    def cp(i):
        return (f"echo START{i} $(date +%s.%N); {tuning.REL}/wanxfer cp --json --quiet --progress-json={files[i - 1]} "
                f"{flags + ' ' if flags else ''}--bytes {sizes[i - 1]} /dev/zero wanxfer://{RIGHT}:7800/dev/null > {files[i - 1]}.out 2>&1 & "
                f"p{i}=$!")
    right = f"{tuning.REL}/wanxfer serve --root /tmp --listen {RIGHT}:7800 >/dev/null 2>&1"
    left = f"{cp(1)}; sleep {gap}; {cp(2)}; sleep {tail}; kill -INT $p1 $p2; wait"
    out, report, err = tuning.run_path(path, right, left, timeout)
    starts = {int(line[5]): float(line.split()[1]) for line in out.splitlines() if line.startswith("START")}
    t0 = report["_started_unix_s"]
    series, finals, progresses = [], [], []
    for i, f in enumerate(files, 1):
        try:
            with open(f) as fh:
                lines = [json.loads(line) for line in fh if line.startswith("{")]
        except (OSError, ValueError) as e:
            raise benchlib.ToolError(f"path {name}, transfer {i}: no progress lines ({e}): {err[-300:]}")
        progress = [p for p in lines if p.get("event") == "progress"]
        if i not in starts or not progress:
            raise benchlib.ToolError(f"path {name}, transfer {i} moved nothing: {err[-300:]}")
        progresses.append((starts[i] - t0, progress))
        # The sockets' rate where the client sampled them (`network_bits_per_s`); the
        # block count (`bits_per_s`) steps by 4 MiB and is kept beside it.
        series.append([{"t_s": starts[i] - t0 + p["t_s"],
                        "bits_per_s": benchlib.line_rate(p),
                        "block_bits_per_s": p["bits_per_s"], "streams": p.get("streams"),
                        "retransmits": sum(c.get("retransmits") or 0 for c in p.get("channels") or [])}
                       for p in progress])
        # What each controller decided and why, on the emulator's clock.
        finals.append({"streams": progress[-1].get("streams"),
                       "decisions": [{"t_s": starts[i] - t0 + d["at_s"], "streams": d["streams"],
                                      "pacing_bits_per_s": d.get("pacing_bits_per_s"), "reason": d["reason"]}
                                     for p in progress for d in p.get("decisions") or []]})
    lo = starts[2] - t0 + after
    hi = lo + window
    means = []
    for s in series:
        inside = [p["bits_per_s"] for p in s if lo < p["t_s"] <= hi]
        means.append(sum(inside) / len(inside) if inside else 0.0)
    # The streams each ran over the window, and their TCP windows: BBR streams sharing a
    # standing queue keep the split their windows have, so a transfer ahead at an equal
    # count shows it here (the shares follow the windows' sums).
    over = []
    for offset, progress in progresses:
        up = [[c for c in p.get("channels") or [] if c.get("state") == "up"]
              for p in progress if lo < offset + p["t_s"] <= hi]
        cwnd = [c["cwnd"] for u in up for c in u if c.get("cwnd") is not None]
        over.append({"streams": sum(len(u) for u in up) / len(up) if up else 0.0,
                     "cwnd_per_stream": sum(cwnd) / len(cwnd) if cwnd else None})
    both = sum(means)
    ceiling = bps * tuning.GOODPUT
    # Both must still be running over the whole window, else the shares mean nothing.
    overlap = all(s and s[-1]["t_s"] >= hi for s in series)
    shares = [m / both if both else 0.0 for m in means]
    return {"path": name, "what": spec["what"], "sizes": sizes, "second_start_s": starts[2] - t0,
            "window_s": [lo, hi], "both_running_through_window": overlap,
            "mean_gbit_per_s": [m / 1e9 for m in means], "shares": shares,
            "of_half_ceiling": [m / (ceiling / 2) for m in means],
            "within_20pct_of_equal": overlap and all(abs(s - 0.5) <= 0.1 for s in shares),
            "final": finals, "over_window": over,
            "ceiling_gbit_per_s": ceiling / 1e9, "emu": tuning.emu_summary(report), "series": series}


def svg(results, path):
    """One panel per path: each transfer's Gbit/s against seconds, the window shaded."""
    w, h, pad = 560, 320, 55
    g = []
    for k, r in enumerate(results):
        ox = k * (w + 20)
        pts = [p for s in r["series"] for p in s]
        tmax = max([p["t_s"] for p in pts] + [r["window_s"][1]]) or 1
        ymax = max([p["bits_per_s"] / 1e9 for p in pts] + [r["ceiling_gbit_per_s"]]) * 1.1
        X = lambda t: ox + pad + t / tmax * (w - 2 * pad)  # noqa: E731
        Y = lambda v: h - pad - v / ymax * (h - 2 * pad)  # noqa: E731
        lo, hi = r["window_s"]
        g += [f'<rect x="{X(lo):.1f}" y="{pad}" width="{X(hi) - X(lo):.1f}" height="{h - 2 * pad}" fill="#eee"/>',
              f'<text x="{ox + w / 2}" y="20" text-anchor="middle" font-size="14">path ({r["path"]}): {r["what"]}</text>',
              f'<line x1="{ox + pad}" y1="{h - pad}" x2="{ox + w - pad}" y2="{h - pad}" stroke="black"/>',
              f'<line x1="{ox + pad}" y1="{pad}" x2="{ox + pad}" y2="{h - pad}" stroke="black"/>',
              f'<text x="{ox + w / 2}" y="{h - 15}" text-anchor="middle" font-size="12">seconds since the emulator started</text>',
              f'<text x="{ox + 15}" y="{h / 2}" font-size="12" transform="rotate(-90 {ox + 15} {h / 2})" '
              f'text-anchor="middle">Gbit/s</text>',
              f'<line x1="{ox + pad}" y1="{Y(r["ceiling_gbit_per_s"]):.1f}" x2="{ox + w - pad}" '
              f'y2="{Y(r["ceiling_gbit_per_s"]):.1f}" stroke="gray" stroke-dasharray="4 3"/>',
              f'<line x1="{ox + pad}" y1="{Y(r["ceiling_gbit_per_s"] / 2):.1f}" x2="{ox + w - pad}" '
              f'y2="{Y(r["ceiling_gbit_per_s"] / 2):.1f}" stroke="gray" stroke-dasharray="1 3"/>']
        for i, s in enumerate(r["series"]):
            g.append(f'<polyline fill="none" stroke="{COLORS[i]}" stroke-width="1.5" points="' +
                     " ".join(f"{X(p['t_s']):.1f},{Y(p['bits_per_s'] / 1e9):.1f}" for p in s) + '"/>')
            g.append(f'<text x="{ox + pad + 10}" y="{pad + 14 * (i + 1)}" font-size="11" fill="{COLORS[i]}">'
                     f'transfer {i + 1}: share {r["shares"][i]:.2f}</text>')
        for v in range(0, int(tmax) + 1, max(1, int(tmax) // 8)):
            g.append(f'<text x="{X(v):.1f}" y="{h - pad + 15}" font-size="10" text-anchor="middle">{v}</text>')
        step = ymax / 5
        for j in range(6):
            g.append(f'<text x="{ox + pad - 5}" y="{Y(j * step) + 3:.1f}" font-size="10" text-anchor="end">'
                     f'{j * step:.2f}</text>')
    with open(path, "w") as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{len(results) * (w + 20)}" height="{h}" '
                f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>{"".join(g)}</svg>\n')


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--paths", default="a,b")
    ap.add_argument("--gap", type=float, default=10.0, help="seconds between the two starts")
    ap.add_argument("--after", type=float, default=30.0, help="seconds after the second start the window opens")
    ap.add_argument("--window", type=float, default=10.0, help="seconds the shares are averaged over")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "runs", "fairness"))
    ap.add_argument("--flags", default="", help="extra `wanxfer cp` flags for both transfers (a control run, "
                    "e.g. --streams 3: then it is not the target's no-flags run, and the output says so)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces)")
    if not tuning.BIN_DIR:
        benchlib.sh(["cargo", "build", "--release", "-q", "-p", "wanxfer", "-p", "wanxfer-emu"], cwd=ROOT)
    results = []
    for name in a.paths.split(","):
        if name not in tuning.PATHS or tuning.PATHS[name]["steps"]:
            sys.exit(f"--paths: {name!r} is not one of the issue's fixed paths a-e")
        timeout = 4 * (a.gap + a.after + a.window) + 120
        try:
            results.append(run(name, a.gap, a.after, a.window, timeout, a.flags))
        except benchlib.ToolError as e:
            sys.exit(f"fairness on path {name}: {e}")
        print(json.dumps({k: v for k, v in results[-1].items() if k != "series"}), flush=True)
    smoke = a.after < 30
    meta = {"machine": benchlib.machine(), "load": benchlib.loadavg(), "binaries": tuning.REL,
            "gap_s": a.gap, "after_s": a.after, "window_s": a.window, "smoke": smoke, "flags": a.flags}
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    svg(results, a.out + ".svg")
    tuned = f"`{a.flags}`" if a.flags else "no tuning flags"
    lines = [f"# Two wanxfer transfers ({tuned}) sharing one bottleneck through wanxfer-emu", "",
             f"Command: `sudo bench/fairness.py --paths {a.paths} --gap {a.gap:g} --after {a.after:g} "
             f"--window {a.window:g}" + (f" --flags='{a.flags}'" if a.flags else "") + "`"
             + (f" -- **a control run with `{a.flags}`, not the target's no-flags run**" if a.flags else "") + (" -- **a smoke run: the target is measured 30 s after the second "
                                          "start**" if smoke else ""), "",
             f"Machine: {meta['machine']}; load {meta['load']}. Shares are each transfer's mean rate (its 1 s "
             "--progress-json lines) over the window, of the two rates' sum; target 0.4-0.6 each.", "",
             "| path | window s | transfer 1 Gbit/s | transfer 2 Gbit/s | shares | of half the ceiling | both ran through | "
             "within 20% | streams at the window's end | streams over the window | TCP window per stream over it, segments |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['path']} ({r['what']}) | {r['window_s'][0]:.1f}-{r['window_s'][1]:.1f} | "
                     f"{r['mean_gbit_per_s'][0]:.3f} | {r['mean_gbit_per_s'][1]:.3f} | "
                     f"{r['shares'][0]:.2f} / {r['shares'][1]:.2f} | "
                     f"{r['of_half_ceiling'][0]:.2f} / {r['of_half_ceiling'][1]:.2f} | "
                     f"{'yes' if r['both_running_through_window'] else 'no'} | "
                     f"{'yes' if r['within_20pct_of_equal'] else 'no'} | "
                     f"{r['final'][0]['streams']} / {r['final'][1]['streams']} | "
                     f"{r['over_window'][0]['streams']:.1f} / {r['over_window'][1]['streams']:.1f} | "
                     + " / ".join("-" if o["cwnd_per_stream"] is None else f"{o['cwnd_per_stream']:.0f}"
                                  for o in r["over_window"]) + " |")
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
