#!/usr/bin/env python3
"""Third-party copy between two servers on loopback: wanxfer against GridFTP and XRootD
(issue 20, benchmarks).

Each tool runs two fresh servers (source A, destination B) and a client that only drives
the copy: `wanxfer cp wanxfer://A/x wanxfer://B/y`, `globus-url-copy ftp://A/x ftp://B/y`
(GridFTP's third-party mode, anonymous servers as bench/peers.py starts them) and
`xrdcp --tpc only root://A//x root://B//y` (both xrootd servers with `ofs.tpc pgm
/usr/bin/xrdcp -f`: B pulls from A with a helper xrdcp per file, no authentication).
Workloads: `small64` 20,000 x 64 KiB files in 100 directories and `big` one 4 GiB file
(--full); --quick shrinks them to a smoke test. Source and destination on tmpfs; every
destination is compared byte for byte with the source (a run that does not verify is
FAILED). CPU seconds per side from the kernel, as bench/benchlib.py measures them: the
source server's and the destination server's process trees (/proc deltas of fresh
servers) and the client's (wait4 rusage). Ratios are wanxfer's rate over each peer's,
from the same run.

`--small-files-for TOOL=N` gives TOOL a tree of only N of the small64 files (same size,
same 100 directories): xrdcp's third-party mode runs one helper per file, about 2.5 s a
file here, so 20,000 would take hours; its rates still compare, and its row says so.

usage: bench/tpc.py [--quick | --full] [--only wanxfer,gridftp,xrdcp] [--workloads big,small64]
                    [--small-files-for TOOL=N] [--repeat N] [--timeout S] [--out-dir bench/runs]
"""
import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (  # noqa: E402
    ROOT, Server, ToolError, build_wanxfer, compare_trees, cpu_model, free_port, loadavg, mem_gib, run_client,
    tree_stats, wanxfer_env, wanxfer_server,
)

GIB = 1 << 30
SIZES = {
    "full": {"big_mib": 4096, "small64": 20000},
    "quick": {"big_mib": 256, "small64": 500},
}
WORKLOADS = ["big", "small64"]
TOOLS = ["wanxfer", "gridftp", "xrdcp"]
KNOBS = {
    "wanxfer": {"big": [["--streams", "2", "--block-size", "4MiB"]],
                "small64": [["--streams", "2", "--block-size", "4MiB"]]},
    "gridftp": {"big": [["-fast", "-p", "4"]], "small64": [["-fast", "-cc", "16"]]},
    "xrdcp": {"big": [[]], "small64": [["--parallel", "16"]]},
}
BINARIES = {"wanxfer": [], "gridftp": ["globus-url-copy", "globus-gridftp-server"], "xrdcp": ["xrdcp", "xrootd"]}


def installed(tool):
    return all(shutil.which(b) for b in BINARIES[tool])


def fresh(path):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    os.chmod(path, 0o777)  # gridftp and xrootd write as 'nobody'
    return path


def tpc_wanxfer(ctx, src_root, name, dst_root, knobs):
    env = ctx["env"]
    a = wanxfer_server(ctx["binary"], src_root, env, flags=["--state-dir", os.path.join(ctx["work"], "state-a")])
    b = wanxfer_server(ctx["binary"], dst_root, env, flags=["--state-dir", os.path.join(ctx["work"], "state-b")])
    try:
        out, ccpu, wall = run_client([ctx["binary"], "cp", "--json", *knobs, f"wanxfer://{a.line}/{name}",
                                      f"wanxfer://{b.line}/out"], env=env, timeout=ctx["timeout"])
        r = json.loads(out)
        t = r["third_party"]
        note = (f"client moved {t['client_tcp_bytes_sent']} B out, {t['client_tcp_bytes_received']} B in "
                f"over its own connections")
        return ccpu, wall, a.cpu(), b.cpu(), os.path.join(dst_root, "out"), note
    finally:
        a.stop()
        b.stop()


def gridftp_server():
    port = free_port()
    return Server(["globus-gridftp-server", "-aa", "-anonymous-user", "nobody", "-p", str(port), "-d", "error"],
                  port=port), port


def tpc_gridftp(ctx, src_root, name, dst_root, knobs):
    (a, pa), (b, pb) = gridftp_server(), gridftp_server()
    try:
        src = os.path.join(src_root, name)
        out = os.path.join(dst_root, "out")
        if os.path.isdir(src):
            args = ["-r", "-cd", *knobs, f"ftp://127.0.0.1:{pa}{src}/", f"ftp://127.0.0.1:{pb}{out}/"]
        else:
            args = [*knobs, f"ftp://127.0.0.1:{pa}{src}", f"ftp://127.0.0.1:{pb}{out}"]
        _, ccpu, wall = run_client(["globus-url-copy", *args], timeout=ctx["timeout"])
        return ccpu, wall, a.cpu(), b.cpu(), out, "third-party (both URLs ftp://)"
    finally:
        a.stop()
        b.stop()


def xrootd_server(ctx, export, tag):
    port = free_port()
    admin = fresh(os.path.join(ctx["work"], f"xrd-admin-{tag}"))
    cfg = os.path.join(ctx["work"], f"xrootd-{tag}.cfg")
    with open(cfg, "w") as f:
        f.write(f"all.export {export}\nxrd.port {port}\nall.adminpath {admin}\nall.pidpath {admin}\n"
                "ofs.tpc pgm /usr/bin/xrdcp -f\n")
    return Server(["xrootd", "-c", cfg, "-l", os.path.join(admin, "xrootd.log"), "-R", "nobody"], port=port), port


def tpc_xrdcp(ctx, src_root, name, dst_root, knobs):
    (a, pa), (b, pb) = xrootd_server(ctx, src_root, "a"), xrootd_server(ctx, dst_root, "b")
    try:
        src = os.path.join(src_root, name)
        if os.path.isdir(src):
            out = fresh(os.path.join(dst_root, "out"))
            args = ["-r", *knobs, f"root://127.0.0.1:{pa}/{src}/", f"root://127.0.0.1:{pb}/{out}/"]
            result = os.path.join(out, name)
        else:
            result = os.path.join(dst_root, "out")
            args = [*knobs, f"root://127.0.0.1:{pa}/{src}", f"root://127.0.0.1:{pb}/{result}"]
        _, ccpu, wall = run_client(["xrdcp", "--tpc", "only", "-s", *args], timeout=ctx["timeout"])
        # The destination's helper xrdcp processes are its children: counted in its tree.
        return ccpu, wall, a.cpu(), b.cpu(), result, "xrdcp --tpc only (destination pulls, one helper per file)"
    finally:
        a.stop()
        b.stop()


RUN = {"wanxfer": tpc_wanxfer, "gridftp": tpc_gridftp, "xrdcp": tpc_xrdcp}


def run_one(ctx, tool, wl, knobs, src_root, name, stats):
    dst_root = fresh(os.path.join(ctx["work"], "dst"))
    try:
        ccpu, wall, acpu, bcpu, out, note = RUN[tool](ctx, src_root, name, dst_root, knobs)
        src = os.path.join(src_root, name)
        if os.path.isdir(src):
            ok, n, why = compare_trees(src, out) if os.path.isdir(out) else (False, 0, f"{out} missing")
            ok = ok and n == stats[0]
        else:
            ok = subprocess.run(["cmp", "-s", src, out]).returncode == 0
            why = "" if ok else f"{out} differs from {src}"
        r = {"seconds": wall, "gbit": stats[1] * 8 / wall / 1e9, "files_per_s": stats[0] / wall,
             "client_cpu_s": ccpu, "source_cpu_s": acpu, "dest_cpu_s": bcpu, "verified": ok,
             "note": note if ok else f"verify: {why}"}
    except Exception as e:  # noqa: BLE001 - a broken tool must not stop the benchmark
        r = {"verified": False, "error": str(e) if isinstance(e, ToolError) else f"{type(e).__name__}: {e}"}
    finally:
        shutil.rmtree(dst_root, ignore_errors=True)
    r.update(tool=tool, workload=wl, knobs=" ".join(knobs) or "(defaults)", bytes=stats[1], files=stats[0])
    return r


def gen(work, wl, size, tag=""):
    root = fresh(os.path.join(work, f"src-{wl}{tag}"))
    d = os.path.join(root, "data")
    gen_py = os.path.join(ROOT, "scripts", "gen-dataset.py")
    args = {"big": ["--large-mib", str(size["big_mib"])],
            "small64": ["--small-count", str(size["small64"]), "--small-kib", "64", "--dirs", "100"]}[wl]
    subprocess.run([sys.executable, gen_py, d, *args], check=True)
    subprocess.run(["chmod", "-R", "a+rX", root], check=True)
    if wl == "big":
        # One file, not a tree: every tool copies the file itself.
        (only,) = [os.path.join(dp, f) for dp, _, fs in os.walk(d) for f in fs]
        os.rename(only, os.path.join(root, "big.bin"))
        shutil.rmtree(d)
        return root, "big.bin", (1, os.path.getsize(os.path.join(root, "big.bin")))
    return root, "data", tree_stats(d)


def render(doc):
    best = {}
    for r in doc["runs"]:
        if r.get("verified"):
            k = (r["tool"], r["workload"])
            if k not in best or r["gbit"] > best[k]["gbit"]:
                best[k] = r
    m = doc["machine"]
    lines = [
        f"# Third-party copy: wanxfer vs GridFTP and XRootD ({doc['mode']} run, {m['started']})", "",
        f"Machine: {m['nproc']} cores ({m['cpu']}), {m['mem_gib']:.0f} GiB RAM, Linux {m['kernel']}; load average "
        f"before {m['load_before']}, after {m['load_after']}. Command: `{doc['command']}`. Loopback, tmpfs to tmpfs, "
        "two fresh servers per run; the client only drives the copy.", "",
        "| workload | tool | Gbit/s | files/s | CPU s source | CPU s destination | CPU s client | wanxfer / tool |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for wl in doc["workloads"]:
        w = best.get(("wanxfer", wl))
        for tool in doc["tools"]:
            r = best.get((tool, wl))
            if not r:
                why = doc["status"].get(f"{tool}/{wl}", "no verified run")
                lines.append(f"| {wl} | {tool} | - | - | - | - | - | {why} |")
                continue
            ratio = f"{w['gbit'] / r['gbit']:.2f}x" if w else "-"
            lines.append(f"| {wl} | {tool} | {r['gbit']:.2f} | {r['files_per_s']:.0f} | {r['source_cpu_s']:.2f} | "
                         f"{r['dest_cpu_s']:.2f} | {r['client_cpu_s']:.2f} | {ratio} |")
    for tool, n in sorted(doc.get("small_files_for", {}).items()):
        if tool in doc["tools"] and "small64" in doc["workloads"]:
            lines += ["", f"{tool} small64 copied {n:,} of the {doc['sizes']['small64']:,} files (--small-files-for): "
                          "its rates are from that tree."]
    lines += ["", "All runs:", ""]
    for r in doc["runs"]:
        what = r.get("error") or (f"{r['gbit']:.2f} Gbit/s, {r['note']}" if r["verified"]
                                  else f"FAILED {r['note']}")
        lines.append(f"- {r['workload']} {r['tool']} `{r['knobs']}`: {what}")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small sizes (default)")
    mode.add_argument("--full", action="store_true", help="the issue's sizes")
    ap.add_argument("--only", default=",".join(TOOLS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--small-files-for", action="append", default=[], metavar="TOOL=N",
                    help="copy only N of the small64 files with TOOL (repeatable)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, help="seconds before a run is killed (120 quick, 3600 full)")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "runs"))
    ap.add_argument("--binary", help="a wanxfer binary to use instead of building target/release/wanxfer")
    a = ap.parse_args()
    mode = "full" if a.full else "quick"
    size = SIZES[mode]
    tools = [t for t in a.only.split(",") if t]
    wls = [w for w in a.workloads.split(",") if w]
    capped = {}
    for item in a.small_files_for:
        tool, _, n = item.partition("=")
        if tool not in TOOLS or not n.isdigit() or int(n) < 1:
            ap.error(f"--small-files-for {item!r}: TOOL=N with TOOL one of {','.join(TOOLS)} and N >= 1")
        capped[tool] = min(int(n), size["small64"])
    binary = a.binary or build_wanxfer()
    started = datetime.datetime.now(datetime.timezone.utc)
    work = tempfile.mkdtemp(prefix="wanxfer-tpc.", dir="/dev/shm")
    os.chmod(work, 0o755)
    ctx = {"work": work, "binary": binary, "env": wanxfer_env(), "timeout": a.timeout or (3600 if a.full else 120)}
    load_before = loadavg()
    runs, status = [], {}
    try:
        for wl in wls:
            print(f"== generating {wl}", flush=True)
            src_root, name, stats = gen(work, wl, size)
            for tool in tools:
                if not installed(tool):
                    status[f"{tool}/{wl}"] = "not installed"
                    continue
                tree = (src_root, name, stats)
                if wl == "small64" and tool in capped:
                    print(f"== generating {wl} for {tool}: {capped[tool]} files", flush=True)
                    tree = gen(work, wl, {**size, "small64": capped[tool]}, tag=f"-{tool}")
                for knobs in KNOBS[tool][wl]:
                    for _ in range(a.repeat):
                        r = run_one(ctx, tool, wl, knobs, *tree)
                        runs.append(r)
                        msg = (r.get("error") or (f"{r['gbit']:.2f} Gbit/s cpu source {r['source_cpu_s']:.2f}s "
                                                  f"destination {r['dest_cpu_s']:.2f}s client {r['client_cpu_s']:.2f}s"
                                                  if r["verified"] else f"FAILED {r['note']}"))
                        print(f"{wl:8} {tool:8} {r['knobs']:28} {msg}", flush=True)
                if tree[0] != src_root:
                    shutil.rmtree(tree[0], ignore_errors=True)
            shutil.rmtree(src_root, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mach = {"nproc": os.cpu_count(), "cpu": cpu_model(), "mem_gib": mem_gib(), "kernel": os.uname().release,
            "load_before": load_before, "load_after": loadavg(), "started": started.isoformat(timespec="seconds")}
    doc = {"mode": mode, "command": "bench/tpc.py " + " ".join(sys.argv[1:]), "machine": mach, "sizes": size,
           "tools": tools, "workloads": wls, "small_files_for": capped, "runs": runs, "status": status}
    text = render(doc)
    print(text)
    os.makedirs(a.out_dir, exist_ok=True)
    stem = os.path.join(a.out_dir, f"tpc-{started:%Y-%m-%d}-{mode}")
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {stem}.md and {stem}.json")


if __name__ == "__main__":
    main()
