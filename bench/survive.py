#!/usr/bin/env python3
"""What surviving costs, and what it saves: the benchmarks of the hardening and session
protocol 2 issues, on loopback and (failover) through wanxfer-emu.

  durability  push 20,000 x 64 KiB and one 4 GiB file to a server on this machine's disk,
              syncing (the default) against `serve --no-fsync`   (target: <= 1.10x)
  journal     the same workloads, resumable (the default) against `cp --no-resume`
              (target: <= 1.03x)
  noop        re-run of a completed 20,000 x 64 KiB copy: wanxfer against `rsync -a` to
              an rsync daemon, both over loopback                 (target: <= 1.0x)
  resume      a 4 GiB push killed at about half, run again: bytes sent in total against
              4 GiB                                  (target: 4 GiB + one in-flight window)
  failover    1 GiB over 4 streams through wanxfer-emu, one stream blackholed mid-way:
              throughput before and after (target: completes, keeps >= 3/4 of its rate)

Runs alternate A B A B (the machine drifts); medians and the pairwise ratios are
reported with CPU seconds per side. Data lives under --dir (default /var/tmp, which must
be a real disk file system for durability and journal to mean anything).

usage: bench/survive.py [--only durability,journal,noop,resume,failover] [--repeat 3]
                        [--dir /var/tmp] [--out bench/runs/survive-DATE]
Needs root for failover (network namespaces) and for dropping caches.
"""
import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (  # noqa: E402
    ROOT, WANXFER, Server, build_wanxfer, compare_trees, free_port, loadavg, machine, run_client,
    wanxfer_env, wanxfer_server)

GEN = os.path.join(ROOT, "scripts", "gen-dataset.py")
EMU = os.path.join(ROOT, "target", "release", "wanxfer-emu")


def fstype(path):
    out = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", path], capture_output=True, text=True)
    return out.stdout.strip()


def serve(root, flags=()):
    """A wanxfer server on loopback, logging to serve.log beside its root; returns (Server,
    address)."""
    log = open(os.path.join(os.path.dirname(root), "serve.log"), "a")
    srv = wanxfer_server(WANXFER, root, wanxfer_env(), flags, stderr=log)
    return srv, srv.line


def cp(args):
    out, cpu, wall = run_client([WANXFER, "cp", "--quiet", "--json", *args], env=wanxfer_env())
    return json.loads(out.strip().splitlines()[-1]), cpu, wall


def settle():
    """Writes back what earlier runs left dirty, so that no run pays for another's."""
    subprocess.run(["sync"])
    time.sleep(1)


# Files in the small workload and MiB in the big one; --quick divides both by ten.
SIZES = {"small": 20000, "big_mib": 4096}


def dataset(base, name):
    path = os.path.join(base, name)
    if not os.path.isdir(path):
        args = {"small64": ["--small-count", str(SIZES["small"]), "--small-kib", "64"],
                "big": ["--large-mib", str(SIZES["big_mib"])]}[name]
        subprocess.run([sys.executable, GEN, path, *args], check=True)
    return path


def paired(label, runs_a, runs_b, target):
    """Medians of A and B, the median of the pairwise ratios A/B, CPU per side."""
    ratios = [a["wall"] / b["wall"] for a, b in zip(runs_a, runs_b)]
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    return {
        "what": label,
        "a_wall_s": med(runs_a, "wall"), "b_wall_s": med(runs_b, "wall"),
        "a_client_cpu_s": med(runs_a, "ccpu"), "b_client_cpu_s": med(runs_b, "ccpu"),
        "a_server_cpu_s": med(runs_a, "scpu"), "b_server_cpu_s": med(runs_b, "scpu"),
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "target": target,
    }


def push_ab(base, workload, a, b, repeat):
    """Pushes `workload` repeat times under setting A and under B, alternating. A setting
    is (server flags, client flags)."""
    src = dataset(base, workload)
    runs = {"a": [], "b": []}
    for i in range(repeat):
        for key, (sflags, cflags) in (("a", a), ("b", b)):
            root = os.path.join(base, "root")
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
            settle()
            srv, addr = serve(root, sflags)
            try:
                js, ccpu, wall = cp([*cflags, src, f"wanxfer://{addr}/out"])
                scpu = srv.cpu()
            finally:
                srv.stop()
            if i == 0:
                ok, n, diff = compare_trees(src, os.path.join(root, "out"))
                if not ok:
                    raise RuntimeError(f"{workload} {key}: copy differs: {diff}")
            runs[key].append({"wall": wall, "ccpu": ccpu, "scpu": scpu, "bytes": js["bytes"]})
            print(f"  {workload} {key} run {i}: {wall:.2f} s", flush=True)
    shutil.rmtree(os.path.join(base, "root"), ignore_errors=True)
    return runs["a"], runs["b"]


def bench_durability(base, repeat):
    out = []
    for wl in ("small64", "big"):
        a, b = push_ab(base, wl, ((), ()), (("--no-fsync",), ()), repeat)
        out.append(paired(f"{wl}: synced / serve --no-fsync", a, b, "<= 1.10"))
    return out


def bench_journal(base, repeat):
    out = []
    for wl in ("small64", "big"):
        a, b = push_ab(base, wl, ((), ()), ((), ("--no-resume",)), repeat)
        out.append(paired(f"{wl}: resumable / cp --no-resume", a, b, "<= 1.03"))
    return out


def rsync_daemon(root):
    port = free_port()
    cfg = os.path.join(os.path.dirname(root), "rsyncd.conf")
    with open(cfg, "w") as f:
        f.write(f"use chroot = no\nlog file = /dev/null\npid file = {cfg}.pid\n"
                f"[mod]\npath = {root}\nread only = no\nuid = root\ngid = root\n")
    return Server(["rsync", "--daemon", "--no-detach", f"--config={cfg}", "--port", str(port)], port=port), port


def bench_noop(base, repeat):
    """A completed copy re-run: every file is checked and none is sent."""
    if not shutil.which("rsync"):
        return [{"what": "noop", "skipped": "rsync is not installed (scripts/install-bench-deps.sh)"}]
    src = dataset(base, "small64")
    wroot, rroot = os.path.join(base, "w-root"), os.path.join(base, "r-root")
    for d in (wroot, rroot):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    srv, addr = serve(wroot)
    rsrv, port = rsync_daemon(rroot)
    runs = {"a": [], "b": []}
    try:
        cp([src, f"wanxfer://{addr}/out"])
        run_client(["rsync", "-a", f"{src}/", f"rsync://127.0.0.1:{port}/mod/out/"])
        for i in range(repeat):
            srv.mark()
            js, ccpu, wall = cp([src, f"wanxfer://{addr}/out"])
            if js["bytes"] != 0 or js["files_up_to_date"] != SIZES["small"]:
                raise RuntimeError(f"the re-run sent something: {js}")
            runs["a"].append({"wall": wall, "ccpu": ccpu, "scpu": srv.cpu(), "bytes": 0})
            rsrv.mark()
            _, ccpu, wall = run_client(["rsync", "-a", f"{src}/", f"rsync://127.0.0.1:{port}/mod/out/"])
            runs["b"].append({"wall": wall, "ccpu": ccpu, "scpu": rsrv.cpu(), "bytes": 0})
            print(f"  noop run {i}: wanxfer {runs['a'][-1]['wall']:.2f} s, rsync {wall:.2f} s", flush=True)
    finally:
        srv.stop()
        rsrv.stop()
        for d in (wroot, rroot):
            shutil.rmtree(d, ignore_errors=True)
    return [paired("20,000 x 64 KiB no-op re-run: wanxfer / rsync -a (daemon)", runs["a"], runs["b"], "<= 1.0")]


def first_bytes(log_path):
    with open(log_path) as f:
        hits = re.findall(r"\((\d+) bytes received first", f.read())
    return int(hits[-1]) if hits else None


def bench_resume(base, repeat):
    src = os.path.join(dataset(base, "big"), "large.bin")
    size = os.path.getsize(src)
    out = []
    for i in range(repeat):
        root = os.path.join(base, "root")
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        log = os.path.join(base, "serve.log")
        open(log, "w").close()
        srv, addr = serve(root)
        try:
            settle()
            # A clean run's length, to kill the next one at about half.
            t0 = time.monotonic()
            cp([src, f"wanxfer://{addr}/clean.bin"])
            clean = time.monotonic() - t0
            os.unlink(os.path.join(root, "clean.bin"))
            settle()
            p = subprocess.Popen([WANXFER, "cp", "--quiet", src, f"wanxfer://{addr}/big.bin"],
                                 env=wanxfer_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(clean / 2)
            p.kill()
            p.wait()
            first = None
            for _ in range(200):
                first = first_bytes(log)
                if first is not None:
                    break
                time.sleep(0.05)
            js, ccpu, wall = cp([src, f"wanxfer://{addr}/big.bin"])
            total = (first or 0) + js["bytes"]
            row = {"what": f"{size / 2**30:.1f} GiB push killed at {clean / 2:.1f} s of {clean:.1f} s, run again",
                   "first_run_bytes": first, "rerun_bytes": js["bytes"], "rerun_held": js["bytes_skipped"],
                   "total_bytes": total, "file_bytes": size, "over_bytes": total - size,
                   "rerun_wall_s": wall, "target": "<= 4 GiB + one in-flight window"}
            print(f"  resume run {i}: {row}", flush=True)
            out.append(row)
        finally:
            srv.stop()
            shutil.rmtree(root, ignore_errors=True)
    return out


def received_bytes(pid):
    """Bytes the process has read (sockets included): /proc/PID/io rchar."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        return None


def server_pid(root):
    out = subprocess.run(["pgrep", "-f", f"wanxfer serve --root {root}"], capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    return pids[0] if pids else None


def failover_run(base, size, rate, rtt, cut_at):
    """One push through the emulator; returns (client json, [(t, received bytes)])."""
    root = os.path.join(base, "emu-root")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    src = os.path.join(base, "emu-src.bin")
    if not os.path.exists(src) or os.path.getsize(src) != size:
        with open(src, "wb") as f:
            f.write(os.urandom(size))
    cut = [] if cut_at is None else ["--cut-flow", f"3@{cut_at}s.."]
    cmd = [EMU, "--cpu", "1", "--rtt", f"{rtt}ms", "--rate", rate, *cut,
           "--right", f"{WANXFER} serve --root {root} --listen 10.77.0.2:7800 --stall-timeout 3 2>/dev/null",
           "--left", f"{WANXFER} cp --quiet --json --streams 4 --stall-timeout 3 {src} "
                     f"wanxfer://10.77.0.2:7800/out.bin"]
    samples = []
    done = threading.Event()

    def sample():
        pid, t0 = None, None
        while not done.is_set():
            pid = pid or server_pid(root)
            if pid:
                n = received_bytes(pid)
                if n is not None:
                    t0 = t0 or time.monotonic()
                    samples.append((time.monotonic() - t0, n))
            time.sleep(0.1)

    t = threading.Thread(target=sample)
    t.start()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=wanxfer_env(), timeout=900)
    finally:
        done.set()
        t.join()
    lines = [l for l in res.stdout.splitlines() if l.startswith("{\"bytes\"")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"failover run failed ({res.returncode}): {res.stderr[-400:]}")
    ok = open(src, "rb").read() == open(os.path.join(root, "out.bin"), "rb").read()
    if not ok:
        raise RuntimeError("the copy differs")
    shutil.rmtree(root, ignore_errors=True)
    return json.loads(lines[0]), samples


def rate_between(samples, t_from, t_to):
    inside = [(t, n) for t, n in samples if t_from <= t <= t_to]
    if len(inside) < 2:
        return None
    (ta, na), (tb, nb) = inside[0], inside[-1]
    return (nb - na) * 8 / (tb - ta) / 1e9 if tb > ta else None


def bench_failover(base, repeat):
    if os.geteuid() != 0 or not os.path.exists(EMU):
        return [{"what": "failover", "skipped": "needs root and target/release/wanxfer-emu"}]
    size, rate, rtt = 1 << 30, "500mbit", 20
    out = []
    for i in range(repeat):
        clean, _ = failover_run(base, size, rate, rtt, None)
        half = clean["seconds"] / 2
        js, samples = failover_run(base, size, rate, rtt, half)
        before = rate_between(samples, 1.0, half)
        after = rate_between(samples, half + 4.0, js["seconds"] - 0.5)
        row = {"what": f"1 GiB, 4 streams, {rate}, {rtt} ms RTT; stream 2 of 4 dark from {half:.1f} s",
               "clean_gbit": clean["gbit_per_s"], "clean_s": clean["seconds"],
               "failover_s": js["seconds"], "channels_lost": js["channels_lost"], "attempts": js["attempts"],
               "gbit_before": before, "gbit_after_detection": after,
               "kept": (after / before) if before and after else None, "target": ">= 0.75 kept"}
        print(f"  failover run {i}: {row}", flush=True)
        out.append(row)
    return out


BENCHES = {"durability": bench_durability, "journal": bench_journal, "noop": bench_noop,
           "resume": bench_resume, "failover": bench_failover}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(BENCHES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--keep-data", action="store_true", help="keep the generated datasets")
    ap.add_argument("--quick", action="store_true", help="a tenth of the sizes: a smoke test of the harness")
    date = datetime.date.today().isoformat()
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "runs", f"survive-{date}"))
    a = ap.parse_args()
    if a.quick:
        SIZES.update(small=SIZES["small"] // 10, big_mib=SIZES["big_mib"] // 10)
        a.out += "-quick"
    build_wanxfer()
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "wanxfer-emu"], cwd=ROOT, check=True)
    base = tempfile.mkdtemp(prefix="wanxfer-survive-", dir=a.dir)
    results = {"machine": machine(), "fs": fstype(base), "dir": a.dir, "load_before": loadavg(), "benches": {}}
    print(f"data under {base} ({results['fs']})", flush=True)
    try:
        for name in a.only.split(","):
            print(f"== {name}", flush=True)
            results["benches"][name] = BENCHES[name](base, a.repeat)
    finally:
        results["load_after"] = loadavg()
        if not a.keep_data:
            shutil.rmtree(base, ignore_errors=True)
    with open(a.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(f"# survive.py, {date}\n\n{results['machine']}; data on {results['fs']} ({a.dir}); "
                f"load {results['load_before']} -> {results['load_after']}\n\n")
        for name, rows in results["benches"].items():
            f.write(f"## {name}\n\n")
            for row in rows:
                f.write("- " + ", ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}"
                                         for k, v in row.items()) + "\n")
            f.write("\n")
    print(open(a.out + ".md").read())


if __name__ == "__main__":
    main()
