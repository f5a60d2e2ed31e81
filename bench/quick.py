#!/usr/bin/env python3
"""wanxfer 0.1 benchmark: one run, side by side, on loopback.

1. Memory to memory: iperf3 single stream vs wanxfer (--bytes from /dev/zero to /dev/null),
   Gbit/s and CPU seconds of each side (sender and receiver processes, from the kernel's
   own accounting: wait4 for the client, /proc/PID/stat deltas for the server).
2. Files on tmpfs: 20,000 x 64 KiB files in 100 directories vs one file of the same total
   size, pushed to a server whose root is on tmpfs; every destination byte is compared
   with its source afterwards (a run that does not verify counts as failed).

usage: bench/quick.py [--seconds 10] [--bytes 16GiB] [--repeat 3] [--out FILE.md]
Prints a Markdown table; with --out also writes it (with the machine description).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import ROOT, DestTmpfs, best, build_wanxfer, machine, proc_cpu, run_client, sh, wanxfer_env, wanxfer_server  # noqa: E402


def iperf3(seconds):
    port = "5299"
    srv = subprocess.Popen(["iperf3", "-s", "-1", "-p", port], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    before = proc_cpu(srv.pid)
    out, ccpu, wall = run_client(["iperf3", "-c", "127.0.0.1", "-p", port, "-t", str(seconds), "--json"])
    after = proc_cpu(srv.pid)
    srv.wait()
    end = json.loads(out)["end"]
    byts = end["sum_received"]["bytes"]
    secs = end["sum_received"]["seconds"]
    return {
        "tool": "iperf3 -c (1 stream)",
        "gbit": byts * 8 / secs / 1e9,
        "bytes": byts,
        "send_cpu": ccpu,
        "recv_cpu": (after[0] - before[0]) + (after[1] - before[1]),
    }


def wanxfer_mem(binary, addr, size, env, extra=()):
    out, ccpu, wall = run_client(
        [binary, "cp", "--json", *extra, "--bytes", size, "/dev/zero", f"wanxfer://{addr}/dev/null"], env
    )
    r = json.loads(out)
    return {
        "tool": "wanxfer cp --bytes " + " ".join(extra),
        "gbit": r["gbit_per_s"],
        "bytes": r["bytes"],
        "send_cpu": ccpu,
        "recv_cpu": r["peer_cpu_user_s"] + r["peer_cpu_sys_s"],
        "report": r,
    }


def wanxfer_files(binary, addr, src, dest_name, root, env, extra=()):
    out, ccpu, wall = run_client([binary, "cp", "--json", *extra, src, f"wanxfer://{addr}/{dest_name}"], env)
    r = json.loads(out)
    dst = os.path.join(root, dest_name)
    ok = subprocess.run(["diff", "-r", "-q", src, dst], capture_output=True).returncode == 0
    shutil.rmtree(dst)
    return {
        "gbit": r["gbit_per_s"],
        "files_per_s": r["files_per_s"],
        "files": r["files"],
        "bytes": r["bytes"],
        "send_cpu": ccpu,
        "recv_cpu": r["peer_cpu_user_s"] + r["peer_cpu_sys_s"],
        "verified": ok,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=10, help="iperf3 duration")
    ap.add_argument("--bytes", default="16GiB", help="wanxfer memory-to-memory size")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()

    binary = build_wanxfer()
    env = wanxfer_env()
    work = tempfile.mkdtemp(prefix="wanxfer-bench.", dir="/dev/shm")
    dest_fs = DestTmpfs(work)
    lines = []
    try:
        root = os.path.join(dest_fs.path, "root")
        os.makedirs(root)
        srv = wanxfer_server(binary, root, env)
        addr = srv.line
        try:
            ip = [iperf3(a.seconds) for _ in range(a.repeat)]
            wx = [wanxfer_mem(binary, addr, a.bytes, env) for _ in range(a.repeat)]
            wx1 = [wanxfer_mem(binary, addr, a.bytes, env, ("--streams", "1")) for _ in range(a.repeat)]
            wxn = [wanxfer_mem(binary, addr, a.bytes, env, ("--no-block-checksum", "--no-file-digest")) for _ in range(a.repeat)]
            ib, wb, w1, wn = best(ip), best(wx), best(wx1), best(wxn)
            lines += [
                "## Memory to memory (loopback, best of %d)" % a.repeat,
                "",
                "| tool | Gbit/s | sender CPU s/GB | receiver CPU s/GB | ratio to iperf3 |",
                "|---|---|---|---|---|",
            ]
            for r in (ib, wb, w1, wn):
                gb = r["bytes"] / 1e9
                lines.append(
                    f"| {r['tool']} | {r['gbit']:.1f} | {r['send_cpu'] / gb:.3f} | {r['recv_cpu'] / gb:.3f} | {r['gbit'] / ib['gbit']:.2f} |"
                )
            gen = os.path.join(ROOT, "scripts", "gen-dataset.py")
            small = os.path.join(work, "small-src")
            sh([sys.executable, gen, small, "--small-count", "20000", "--small-kib", "64", "--dirs", "100"])
            big = os.path.join(work, "big-src")
            sh([sys.executable, gen, big, "--large-mib", str(20000 * 64 // 1024)])
            sf = [wanxfer_files(binary, addr, small, "small", root, env) for _ in range(a.repeat)]
            bf = [wanxfer_files(binary, addr, big, "big", root, env) for _ in range(a.repeat)]
            sb, bb = best(sf), best(bf)
            lines += [
                "",
                "## Files, tmpfs to tmpfs (loopback, best of %d, every byte verified with diff -r)" % a.repeat,
                "",
                "| dataset | Gbit/s | files/s | sender CPU s | receiver CPU s | verified |",
                "|---|---|---|---|---|---|",
                f"| 20,000 x 64 KiB in 100 dirs | {sb['gbit']:.2f} | {sb['files_per_s']:.0f} | {sb['send_cpu']:.2f} | {sb['recv_cpu']:.2f} | {all(r['verified'] for r in sf)} |",
                f"| one {20000 * 64 // 1024} MiB file | {bb['gbit']:.2f} | {bb['files_per_s']:.1f} | {bb['send_cpu']:.2f} | {bb['recv_cpu']:.2f} | {all(r['verified'] for r in bf)} |",
                "",
                f"Small files reach {sb['gbit'] / bb['gbit']:.2f}x the single file's rate.",
            ]
        finally:
            srv.stop()
    finally:
        dest_fs.close()
        shutil.rmtree(work, ignore_errors=True)
    header = [
        "# wanxfer quick benchmark",
        "",
        f"Machine: {machine()}.",
        f"Command: `bench/quick.py --seconds {a.seconds} --bytes {a.bytes} --repeat {a.repeat}`",
        "wanxfer defaults: 2 streams, 4 MiB blocks, depth 4, block CRC-32C and file XXH3-128 on.",
        f"Files go tmpfs to tmpfs; {dest_fs.describe()}.",
        f"{dest_fs.reporting.describe()}.",
        "",
    ]
    text = "\n".join(header + lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
