#!/usr/bin/env python3
"""How faithful is wanxfer-emu? Measures, through the emulator, on this machine:

1. delay: ping RTT against the setting (10, 50, 100, 200 ms);
2. rate: iperf3 (one stream, first 2 s omitted) against the bottleneck setting at several
   RTTs, with the emulator's queue drops, TUN drops and CPU;
3. loss and reordering: the realised rates against the settings, and the sender's
   retransmissions against the emulator's drops.

usage: sudo bench/emu_fidelity.py [--quick] [--out FILE.md]     (needs root)
"""
import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMU = os.path.join(ROOT, "target", "release", "wanxfer-emu")


def emu(settings, left, right=None):
    """Runs LEFT (and RIGHT in the background) through the emulator; returns (left's
    stdout, the emulator's report)."""
    cmd = [EMU, "--cpu", "1", *settings, "--left", left]
    if right:
        cmd += ["--right", right]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = p.stdout
    # The left command's output comes first, the emulator's JSON report last.
    at = out.rfind('{\n  "seed"')
    return out[:at], json.loads(out[at:])


def ping_rtt(rtt_ms, count):
    out, _ = emu(["--rtt", f"{rtt_ms}ms"], f"ping -c {count} -i 0.05 10.77.0.2")
    times = [float(t) for t in re.findall(r"time=([\d.]+) ms", out)]
    return min(times), sum(times) / len(times), max(times)


def iperf(settings, seconds, omit=2):
    out, report = emu(
        settings,
        f"taskset -c 0 iperf3 -c 10.77.0.2 -t {seconds} -O {omit} -J",
        "iperf3 -s -1 >/dev/null 2>&1",
    )
    j = json.loads(out)
    end = j["end"]
    return end["sum_received"]["bits_per_second"], end["sum_sent"].get("retransmits", 0), report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces)")
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "wanxfer-emu"], cwd=ROOT, check=True)
    secs = 4 if a.quick else 8
    load = open("/proc/loadavg").read().split()[:3]
    lines = ["# wanxfer-emu fidelity", "", f"Machine: {os.cpu_count()} cores; emulator pinned to core 1, endpoints to core 0; "
             f"load average at start {' '.join(load)} (other jobs share the cores).", ""]

    lines += ["## Delay (ping, 40 probes)", "", "| RTT set | min | mean | max | mean - set |", "|---|---|---|---|---|"]
    for rtt in (10, 50, 100, 200):
        lo, mean, hi = ping_rtt(rtt, 10 if a.quick else 40)
        lines.append(f"| {rtt} ms | {lo:.2f} | {mean:.2f} | {hi:.2f} | {mean - rtt:+.2f} ms |")
        print(lines[-1], flush=True)

    lines += ["", f"## Bottleneck rate (iperf3 one stream, {secs} s after 2 s omitted; buffer = max(1 MB, BDP))", "",
              "Goodput ceiling = rate x 1448/1500 (the rate counts IP bytes on the wire; TCP with",
              "timestamps carries 1448 payload bytes per 1500-byte packet).", "",
              "| rate set | RTT | measured | ratio to rate | ratio to goodput ceiling | queue drops | TUN drops | write drops | GSO batches split | emulator CPU |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    rates = [("100mbit", 1e8), ("500mbit", 5e8), ("1gbit", 1e9), ("2gbit", 2e9), ("5gbit", 5e9), ("10gbit", 1e10)]
    rtts = [1, 50] if a.quick else [1, 50, 200]
    for name, bps in rates:
        for rtt in rtts:
            bdp = int(bps * rtt / 1e3 / 8)
            settings = ["--rtt", f"{rtt}ms", "--rate", name, "--buffer", str(max(1_000_000, bdp)),
                        "--tcp-mem", str(max(64 << 20, 4 * bdp))]
            got, _, rep = iperf(settings, secs)
            cpu = rep["cpu_seconds"] / max(rep["wall_seconds"], 1e-9) * 100
            fw = rep["forward"]
            split = f"{fw.get('gso_split', 0)}/{fw.get('gso_batches', 0)}"
            lines.append(f"| {name} | {rtt} ms | {got / 1e9:.3f} Gbit/s | {got / bps:.3f} | {got / (bps * 1448 / 1500):.3f} | "
                         f"{fw['dropped_queue']} | {rep['tun_tx_dropped']} | {fw.get('dropped_write', 0)} | {split} | {cpu:.0f}% |")
            print(lines[-1], flush=True)

    lines += ["", "## Loss and reordering (500 Mbit/s, 20 ms RTT, whole run counted: no omitted seconds)", "",
              "| setting | realised | sender retransmits | emulator drops (loss + queue) |", "|---|---|---|---|"]
    for label, flags, key in [("loss 1%", ["--loss", "0.01"], "dropped_loss"),
                              ("loss 0.1%", ["--loss", "0.001"], "dropped_loss"),
                              ("reorder 1%", ["--reorder", "0.01"], "reordered")]:
        settings = ["--rtt", "20ms", "--rate", "500mbit", "--buffer", "2MB", "--seed", "3", *flags]
        _, retrans, rep = iperf(settings, secs, omit=0)
        f = rep["forward"]
        realised = f[key] / max(f["packets_in"], 1)
        drops = f["dropped_loss"] + f["dropped_queue"]
        lines.append(f"| {label} | {realised * 100:.3f}% | {retrans} | {drops} |")
        print(lines[-1], flush=True)

    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
