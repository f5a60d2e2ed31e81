#!/usr/bin/env python3
"""wanxfer side by side with the tools people use, on loopback (issue #3, part 4).

Tools: iperf3 (single stream, memory-to-memory ceiling), globus-url-copy to
globus-gridftp-server, xrdcp to xrootd, rsync to an rsync daemon, tar | socat, wanxfer.
Workloads (--full sizes; --quick shrinks them for a ~2 minute smoke test):
  mem      8 GiB memory to memory (/dev/zero to /dev/null)
  big      one 4 GiB file
  small64  20,000 x 64 KiB files in 100 directories
  small4   50,000 x 4 KiB files in 100 directories
  mixed    3 GiB tree of log-normally sized files (fixed seed)
Source and destination on tmpfs (/dev/shm); a fresh server per run, destination removed
between runs; every destination tree is compared byte for byte with its source (a run that
does not verify is FAILED). Every push goes client -> server, so client CPU is the sender's
and server CPU the receiver's; see bench/benchlib.py for how CPU is measured.

usage: bench/peers.py [--quick | --full] [--only TOOL,...] [--workloads W,...] [--repeat N]
                      [--timeout S] [--out-dir bench/runs]
       bench/peers.py --render bench/runs/peers-DATE.json   # rewrite the .md from recorded JSON
"""
import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (  # noqa: E402
    ROOT, DestTmpfs, Server, ToolError, build_wanxfer, compare_trees, cpu_model, free_port, loadavg, mem_gib,
    parse_size, run_client, tree_stats, wanxfer_env, wanxfer_server,
)

GIB = 1 << 30
SIZES = {
    "full": {"mem": 8 * GIB, "big_mib": 4096, "small64": 20000, "small4": 50000, "mixed_gib": 3.0},
    "quick": {"mem": 1 * GIB, "big_mib": 256, "small64": 2000, "small4": 5000, "mixed_gib": 0.25},
}
WORKLOADS = ["mem", "big", "small64", "small4", "mixed"]
TOOLS = ["iperf3", "wanxfer", "gridftp", "xrdcp", "rsync", "socat"]
TOOL_NAMES = {
    "iperf3": "iperf3 (1 stream)",
    "wanxfer": "wanxfer",
    "gridftp": "globus-url-copy / gridftp",
    "xrdcp": "xrdcp / xrootd",
    "rsync": "rsync daemon",
    "socat": "tar \\| socat",
}
BINARIES = {
    "iperf3": ["iperf3"],
    "wanxfer": [],
    "gridftp": ["globus-url-copy", "globus-gridftp-server"],
    "xrdcp": ["xrdcp", "xrootd"],
    "rsync": ["rsync"],
    "socat": ["socat", "tar"],
}
MANY = ("small64", "small4", "mixed")
# Knob settings tried per tool and workload; the best verified one is reported.
KNOBS = {
    "iperf3": {"mem": [[], ["-Z"]]},
    # The grid (streams 1/2 x block 1/4 MiB); for files with large blocks also --io copy, as on
    # loopback sendfile's page-fragment skbs cost the receiver more than they save the sender.
    "wanxfer": {w: [["--streams", s, "--block-size", b] for s in ("1", "2") for b in ("1MiB", "4MiB")]
                + ([["--streams", s, "--block-size", "4MiB", "--io", "copy"] for s in ("1", "2")]
                   if w in ("big", "mixed") else [])
                for w in WORKLOADS},
    "gridftp": {
        "mem": [["-fast"], ["-fast", "-p", "4"]],
        "big": [["-fast"], ["-fast", "-p", "4"]],
        **{w: [["-fast", "-pp", "-cc", "4"], ["-fast", "-pp", "-cc", "16"]] for w in MANY},
    },
    "xrdcp": {
        "mem": [],  # see UNSUPPORTED
        "big": [["--streams", "1"], ["--streams", "4"]],
        **{w: [["--parallel", "4"], ["--parallel", "16"]] for w in MANY},
    },
    "rsync": {w: [["-W"], ["-W", "--inplace"]] for w in WORKLOADS if w != "mem"},
    "socat": {
        "mem": [["-b", "131072"], ["-b", "1048576"]],
        **{w: [["-b", "131072"], ["-b", "1048576"]] for w in WORKLOADS if w != "mem"},
    },
}
UNSUPPORTED = {
    ("xrdcp", "mem"): "xrootd has no memory sink: xrdcp - root://host//dev/null fails with "
                      "'[3015] Unable to open /dev/null; block device required'",
    ("rsync", "mem"): "rsync has no memory-to-memory mode",
}


class Ctx:
    def __init__(self, work, binary, timeout, dest_fs):
        self.work = work
        self.binary = binary
        self.timeout = timeout
        self.env = wanxfer_env()
        self.dst = os.path.join(dest_fs.path, "dst")


def fresh_dst(ctx):
    shutil.rmtree(ctx.dst, ignore_errors=True)
    os.makedirs(ctx.dst)
    os.chmod(ctx.dst, 0o777)  # gridftp and xrootd write as 'nobody'
    return ctx.dst


def listening(port):
    """True once something listens on 127.0.0.1:port (without connecting to it)."""
    want = f":{port:04X}"
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                for line in f.readlines()[1:]:
                    parts = line.split()
                    if parts[1].endswith(want) and parts[3] == "0A":
                        return True
        except OSError:
            pass
    return False


def wait_listening(port, proc, timeout=10):
    end = time.monotonic() + timeout
    while not listening(port):
        if proc.poll() is not None or time.monotonic() > end:
            raise ToolError(f"receiver did not listen on {port}")
        time.sleep(0.02)


def result(byts, files, wall, ccpu, scpu, verified, note=""):
    return {"bytes": byts, "files": files, "seconds": wall, "gbit": byts * 8 / wall / 1e9,
            "files_per_s": files / wall if files else 0.0, "client_cpu_s": ccpu, "server_cpu_s": scpu,
            "verified": verified, "note": note}


# ---- memory to memory -------------------------------------------------------------------

def mem_iperf3(ctx, n, knobs):
    port = free_port()
    srv = Server(["iperf3", "-s", "-1", "-p", str(port)], port=None)
    wait_listening(port, srv.p)
    srv.mark()
    try:
        out, ccpu, wall = run_client(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-n", str(n), "--json", *knobs],
                                     timeout=ctx.timeout)
        srv.wait_exit(10)
        end = json.loads(out)["end"]
        sent, got = end["sum_sent"]["bytes"], end["sum_received"]["bytes"]
        # iperf3's receiver summary omits the last partial interval; accept 99 %.
        return result(n, 0, wall, ccpu, srv.cpu(), sent >= n and got >= 0.99 * n,
                      f"sent {sent}, receiver counted {got} bytes")
    finally:
        srv.stop()


def mem_wanxfer(ctx, n, knobs):
    root = fresh_dst(ctx)
    srv = wanxfer_server(ctx.binary, root, ctx.env)
    try:
        out, ccpu, wall = run_client([ctx.binary, "cp", "--json", *knobs, "--bytes", str(n), "/dev/zero",
                                      f"wanxfer://{srv.line}/dev/null"], env=ctx.env, timeout=ctx.timeout)
        r = json.loads(out)
        return result(n, 0, wall, ccpu, srv.cpu(), r["bytes"] == n,
                      f"wanxfer reports {r['bytes']} bytes, {r['gbit_per_s']:.2f} Gbit/s, io {r.get('io', '?')}")
    finally:
        srv.stop()


def gridftp_server(ctx):
    port = free_port()
    srv = Server(["globus-gridftp-server", "-aa", "-anonymous-user", "nobody", "-p", str(port), "-d", "error"],
                 port=port)
    return srv, port


def mem_gridftp(ctx, n, knobs):
    srv, port = gridftp_server(ctx)
    try:
        out, ccpu, wall = run_client(["globus-url-copy", "-vb", *knobs, "-len", str(n), "file:///dev/zero",
                                      f"ftp://127.0.0.1:{port}/dev/null"], timeout=ctx.timeout)
        counted = [int(w.split()[0]) for w in out.replace("\r", "\n").splitlines() if w.strip().endswith("inst")]
        got = counted[-1] if counted else -1
        return result(n, 0, wall, ccpu, srv.cpu(), got == n, f"client counted {got} bytes")
    finally:
        srv.stop()


def mem_socat(ctx, n, knobs):
    port = free_port()
    srv = Server(["socat", "-u", *knobs, f"TCP-LISTEN:{port},reuseaddr", "GOPEN:/dev/null"])
    wait_listening(port, srv.p)
    srv.mark()
    try:
        t0 = time.monotonic()
        _, ccpu, _ = run_client(["socat", "-u", *knobs, f"OPEN:/dev/zero,readbytes={n}", f"TCP:127.0.0.1:{port}"],
                                timeout=ctx.timeout)
        rc = srv.wait_exit(ctx.timeout)
        wall = time.monotonic() - t0
        return result(n, 0, wall, ccpu, srv.cpu(), rc == 0, "exit status only (socat counts no bytes)")
    finally:
        srv.stop()


# ---- files --------------------------------------------------------------------------------

def files_wanxfer(ctx, src, knobs):
    root = fresh_dst(ctx)
    srv = wanxfer_server(ctx.binary, root, ctx.env)
    try:
        out, ccpu, wall = run_client([ctx.binary, "cp", "--json", *knobs, src, f"wanxfer://{srv.line}/out"],
                                     env=ctx.env, timeout=ctx.timeout)
        r = json.loads(out)
        note = f"wanxfer reports {r['gbit_per_s']:.2f} Gbit/s, sent by {r.get('io', '?')}, written {r.get('peer_io', '?')}"
        if r.get("peer_io_fallback"):
            note += f" ({r['peer_io_fallback']})"
        return ccpu, wall, srv.cpu(), os.path.join(root, "out"), note
    finally:
        srv.stop()


def files_gridftp(ctx, src, knobs):
    root = fresh_dst(ctx)
    srv, port = gridftp_server(ctx)
    try:
        out_dir = os.path.join(root, "out")
        _, ccpu, wall = run_client(["globus-url-copy", "-r", "-cd", *knobs, f"file://{src}/",
                                    f"ftp://127.0.0.1:{port}{out_dir}/"], timeout=ctx.timeout)
        return ccpu, wall, srv.cpu(), out_dir, ""
    finally:
        srv.stop()


def files_xrdcp(ctx, src, knobs):
    root = fresh_dst(ctx)
    port = free_port()
    cfg = os.path.join(ctx.work, "xrootd.cfg")
    admin = os.path.join(ctx.work, "xrd-admin")
    os.makedirs(admin, exist_ok=True)
    os.chmod(admin, 0o777)
    with open(cfg, "w") as f:
        f.write(f"all.export {root}\nxrd.port {port}\nall.adminpath {admin}\nall.pidpath {admin}\n")
    srv = Server(["xrootd", "-c", cfg, "-l", os.path.join(admin, "xrootd.log"), "-R", "nobody"], port=port)
    try:
        out_dir = os.path.join(root, "out")
        os.makedirs(out_dir)
        os.chmod(out_dir, 0o777)
        _, ccpu, wall = run_client(["xrdcp", "-r", "-s", *knobs, f"{src}/", f"root://127.0.0.1:{port}/{out_dir}/"],
                                   timeout=ctx.timeout)
        return ccpu, wall, srv.cpu(), os.path.join(out_dir, os.path.basename(src)), ""
    finally:
        srv.stop()


def files_rsync(ctx, src, knobs):
    root = fresh_dst(ctx)
    port = free_port()
    cfg = os.path.join(ctx.work, "rsyncd.conf")
    with open(cfg, "w") as f:
        f.write(f"use chroot = no\nlog file = /dev/null\npid file = {ctx.work}/rsyncd.pid\n"
                f"[mod]\npath = {root}\nread only = no\nuid = root\ngid = root\n")
    srv = Server(["rsync", "--daemon", "--no-detach", f"--config={cfg}", "--port", str(port)], port=port)
    try:
        _, ccpu, wall = run_client(["rsync", "-a", *knobs, f"{src}/", f"rsync://127.0.0.1:{port}/mod/out/"],
                                   timeout=ctx.timeout)
        return ccpu, wall, srv.cpu(), os.path.join(root, "out"), ""
    finally:
        srv.stop()


def files_socat(ctx, src, knobs):
    root = fresh_dst(ctx)
    out_dir = os.path.join(root, "out")
    os.makedirs(out_dir)
    port = free_port()
    b = " ".join(knobs)
    srv = Server(f"socat -u {b} TCP-LISTEN:{port},reuseaddr - | tar -C {out_dir} -xf -", shell=True)
    wait_listening(port, srv.p)
    srv.mark()
    try:
        t0 = time.monotonic()
        _, ccpu, _ = run_client(f"tar -C {src} -cf - . | socat -u {b} - TCP:127.0.0.1:{port}", shell=True,
                                timeout=ctx.timeout)
        rc = srv.wait_exit(ctx.timeout)
        wall = time.monotonic() - t0
        if rc != 0:
            raise ToolError(f"receiver exit {rc}")
        return ccpu, wall, srv.cpu(), out_dir, ""
    finally:
        srv.stop()


MEM = {"iperf3": mem_iperf3, "wanxfer": mem_wanxfer, "gridftp": mem_gridftp, "socat": mem_socat}
FILES = {"wanxfer": files_wanxfer, "gridftp": files_gridftp, "xrdcp": files_xrdcp, "rsync": files_rsync,
         "socat": files_socat}


def run_one(ctx, tool, wl, knobs, src, src_stats):
    try:
        if wl == "mem":
            r = MEM[tool](ctx, src_stats[1], knobs)
        else:
            ccpu, wall, scpu, out, note = FILES[tool](ctx, src, knobs)
            ok, n, why = compare_trees(src, out) if os.path.isdir(out) else (False, 0, f"{out} missing")
            r = result(src_stats[1], src_stats[0], wall, ccpu, scpu, ok and n == src_stats[0],
                       note if ok else f"verify: {why}")
    except Exception as e:  # noqa: BLE001 - a broken tool must not stop the benchmark
        r = {"verified": False, "error": f"{type(e).__name__}: {e}" if not isinstance(e, ToolError) else str(e)}
    finally:
        shutil.rmtree(ctx.dst, ignore_errors=True)
    r.update(tool=tool, workload=wl, knobs=" ".join(knobs) or "(defaults)")
    return r


def installed(tool):
    return all(shutil.which(b) for b in BINARIES[tool])


def version(tool, binary):
    cmds = {
        "iperf3": ["iperf3", "--version"], "gridftp": ["globus-url-copy", "-version"],
        "xrdcp": ["xrdcp", "--version"], "rsync": ["rsync", "--version"], "socat": ["socat", "-V"],
        "wanxfer": [binary, "--version"],
    }
    try:
        p = subprocess.run(cmds[tool], capture_output=True, text=True, timeout=10)
        lines = [ln.strip() for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
        if tool == "socat":
            lines = [ln for ln in lines if ln.startswith("socat version")]
        return lines[0] if lines else "?"
    except Exception as e:  # noqa: BLE001
        return f"? ({e})"


def gen(work, wl, size):
    d = os.path.join(work, f"src-{wl}")
    gen_py = os.path.join(ROOT, "scripts", "gen-dataset.py")
    args = {
        "big": ["--large-mib", str(size["big_mib"])],
        "small64": ["--small-count", str(size["small64"]), "--small-kib", "64", "--dirs", "100"],
        "small4": ["--small-count", str(size["small4"]), "--small-kib", "4", "--dirs", "100"],
        "mixed": ["--lognormal-gib", str(size["mixed_gib"])],
    }[wl]
    subprocess.run([sys.executable, gen_py, d, *args], check=True)
    # Warm the page cache (tmpfs is the page cache, but read it once anyway).
    tree_stats(d)
    return d


def describe_wl(wl, size):
    return {
        "mem": f"{size['mem'] / GIB:g} GiB memory to memory",
        "big": f"one {size['big_mib'] / 1024:g} GiB file",
        "small64": f"{size['small64']:,} x 64 KiB in 100 dirs",
        "small4": f"{size['small4']:,} x 4 KiB in 100 dirs",
        "mixed": f"{size['mixed_gib']:g} GiB log-normal tree (seed 42)",
    }[wl]


def fmt(x, d=2):
    return "-" if x is None else f"{x:.{d}f}"


def evaluate(best):
    """PASS/MISS per target from the issue; best[(tool, wl)] = best verified run."""
    rows = []

    def g(t, w, k="gbit"):
        r = best.get((t, w))
        return r[k] if r else None

    def peers_best(w, tools, k="gbit"):
        vals = [(g(t, w, k), t) for t in tools if g(t, w, k) is not None]
        return max(vals) if vals else (None, None)

    def verdict(cond):
        return "n/a" if cond is None else ("PASS" if cond else "MISS")

    wm, im = best.get(("wanxfer", "mem")), best.get(("iperf3", "mem"))
    if wm and im:
        gbw, gbi = wm["bytes"] / 1e9, im["bytes"] / 1e9
        c = (wm["gbit"] >= 1.5 * im["gbit"] and wm["client_cpu_s"] / gbw <= im["client_cpu_s"] / gbi
             and wm["server_cpu_s"] / gbw <= im["server_cpu_s"] / gbi)
        detail = (f"{wm['gbit']:.2f} vs 1.5 x {im['gbit']:.2f} = {1.5 * im['gbit']:.2f} Gbit/s; sender CPU s/GB "
                  f"{wm['client_cpu_s'] / gbw:.3f} vs {im['client_cpu_s'] / gbi:.3f}; receiver "
                  f"{wm['server_cpu_s'] / gbw:.3f} vs {im['server_cpu_s'] / gbi:.3f}")
    else:
        c, detail = None, "missing run"
    rows.append(("mem-to-mem >= 1.5x iperf3 1-stream Gbit/s, CPU s/GB each side <= iperf3's", verdict(c), detail))

    wb, wmg = g("wanxfer", "big"), g("wanxfer", "mem")
    c = None if wb is None or wmg is None else wb >= 0.9 * wmg
    rows.append(("4 GiB file >= 0.9x wanxfer mem-to-mem", verdict(c),
                 f"{fmt(wb)} vs 0.9 x {fmt(wmg)}" if c is not None else "missing run"))

    ws = g("wanxfer", "small64")
    pb, pt = peers_best("small64", ("gridftp", "xrdcp", "rsync"))
    c1 = None if ws is None or wb is None else ws >= 0.8 * wb
    c2 = None if ws is None or pb is None else ws >= 2 * pb
    rows.append(("20,000 x 64 KiB >= 0.8x the 4 GiB file's Gbit/s", verdict(c1),
                 f"{fmt(ws)} vs 0.8 x {fmt(wb)}"))
    rows.append(("20,000 x 64 KiB >= 2x best of GridFTP, xrdcp, rsync", verdict(c2),
                 f"{fmt(ws)} vs 2 x {fmt(pb)} ({pt})"))

    wf, sf = g("wanxfer", "small4", "files_per_s"), g("socat", "small4", "files_per_s")
    c = None if wf is None or sf is None else wf >= sf
    rows.append(("50,000 x 4 KiB files/s >= tar \\| socat (verified)", verdict(c), f"{fmt(wf, 0)} vs {fmt(sf, 0)} files/s"))

    wx = g("wanxfer", "mixed")
    pb, pt = peers_best("mixed", [t for t in TOOLS if t != "wanxfer"])
    c = None if wx is None or pb is None else wx > pb
    rows.append(("mixed tree: ahead of every peer", verdict(c), f"{fmt(wx)} vs {fmt(pb)} ({pt}) Gbit/s"))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = ap.add_mutually_exclusive_group()
    m.add_argument("--quick", action="store_true", help="small sizes, a ~2 minute smoke test (default)")
    m.add_argument("--full", action="store_true", help="the issue's sizes")
    ap.add_argument("--only", default=",".join(TOOLS), help="tools to run (comma separated)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--repeat", type=int, default=1, help="runs per tool x knobs x workload (best is kept)")
    ap.add_argument("--timeout", type=float, help="seconds before a run is killed (60 quick, 600 full)")
    ap.add_argument("--mem-bytes", help="override the memory-to-memory size (e.g. 8GiB)")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "runs"))
    ap.add_argument("--tag", default="", help="suffix for the output file names (after a dash)")
    ap.add_argument("--render", metavar="RUN.json", help="only rewrite RUN.md from a recorded RUN.json")
    a = ap.parse_args()
    if a.render:
        return rerender(a.render)
    mode = "full" if a.full else "quick"
    size = dict(SIZES[mode])
    if a.mem_bytes:
        size["mem"] = parse_size(a.mem_bytes)
    timeout = a.timeout or (600 if a.full else 60)
    tools = [t for t in a.only.split(",") if t]
    wls = [w for w in a.workloads.split(",") if w]

    binary = build_wanxfer()
    load_before = loadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    work = tempfile.mkdtemp(prefix="wanxfer-peers.", dir="/dev/shm")
    os.chmod(work, 0o755)
    dest_fs = DestTmpfs(work)
    ctx = Ctx(work, binary, timeout, dest_fs)
    runs, status = [], {}
    try:
        for wl in wls:
            src = None
            if wl == "mem":
                stats = (0, size["mem"])
            else:
                need = {"big": size["big_mib"] << 20, "small64": size["small64"] * 68 << 10,
                        "small4": size["small4"] * 8 << 10, "mixed": int(size["mixed_gib"] * GIB)}[wl]
                st = os.statvfs(work)
                if st.f_bavail * st.f_frsize < 2.1 * need:
                    status.update({(t, wl): f"skipped: /dev/shm has {st.f_bavail * st.f_frsize / GIB:.1f} GiB free, "
                                            f"needs {2.1 * need / GIB:.1f}" for t in tools})
                    print(f"== {wl}: not enough space in /dev/shm, skipped", flush=True)
                    continue
                print(f"== generating {describe_wl(wl, size)}", flush=True)
                src = gen(work, wl, size)
                stats = tree_stats(src)
            for tool in tools:
                if not installed(tool) and tool != "wanxfer":
                    status[(tool, wl)] = "not installed"
                    continue
                if (tool, wl) in UNSUPPORTED:
                    status[(tool, wl)] = "unsupported: " + UNSUPPORTED[(tool, wl)]
                    continue
                knob_list = KNOBS.get(tool, {}).get(wl)
                if knob_list is None:
                    continue
                for knobs in knob_list:
                    for _ in range(a.repeat):
                        r = run_one(ctx, tool, wl, knobs, src, stats)
                        runs.append(r)
                        if r.get("error"):
                            msg = f"FAILED {r['error']}"
                        elif not r["verified"]:
                            msg = f"FAILED verification: {r['note']}"
                        else:
                            msg = (f"{r['gbit']:.2f} Gbit/s {r['files_per_s']:.0f} files/s "
                                   f"cpu client {r['client_cpu_s']:.2f}s server {r['server_cpu_s']:.2f}s")
                        print(f"{wl:8} {tool:8} {r['knobs']:32} {msg}", flush=True)
            if src:
                shutil.rmtree(src, ignore_errors=True)
    finally:
        dest_fs.close()
        shutil.rmtree(work, ignore_errors=True)
    load_after = loadavg()
    finished = datetime.datetime.now(datetime.timezone.utc)

    versions = {t: version(t, binary) for t in tools if t == "wanxfer" or installed(t)}
    mach = {
        "nproc": os.cpu_count(), "cpu": cpu_model(), "mem_gib": round(mem_gib(), 1),
        "kernel": os.uname().release, "load_before": load_before, "load_after": load_after,
        "started": started.isoformat(timespec="seconds"), "finished": finished.isoformat(timespec="seconds"),
        "destination": dest_fs.describe(),
        "page_reporting": dest_fs.reporting.describe(),
    }
    doc = {"mode": mode, "command": "bench/peers.py " + " ".join(sys.argv[1:]), "machine": mach,
           "versions": versions, "sizes": size, "repeat": a.repeat, "timeout": timeout, "tools": tools,
           "workloads": wls, "runs": runs, "status": {f"{t}/{w}": s for (t, w), s in status.items()}}
    text = render(doc)
    print(text)
    os.makedirs(a.out_dir, exist_ok=True)
    tag = "-" + a.tag.lstrip("-") if a.tag else ""
    stem = os.path.join(a.out_dir, f"peers-{started:%Y-%m-%d}{'-' + mode if mode != 'full' else ''}{tag}")
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {stem}.md and {stem}.json")


def rate(x):
    return f"{x:.0f}" if x >= 10 else f"{x:.2f}"


def render(doc):
    """Markdown for one run's JSON; also stores the target verdicts in doc["targets"]."""
    runs, size, mach, mode = doc["runs"], doc["sizes"], doc["machine"], doc["mode"]
    tools = doc.get("tools", TOOLS)
    wls = doc.get("workloads", WORKLOADS)
    status = {tuple(k.split("/", 1)): v for k, v in doc.get("status", {}).items()}
    timeout = doc.get("timeout", 600 if mode == "full" else 60)
    started = datetime.datetime.fromisoformat(mach["started"])
    best = {}
    for r in runs:
        if r.get("verified") and "gbit" in r:
            k = (r["tool"], r["workload"])
            key = "files_per_s" if r["workload"] == "small4" else "gbit"
            if k not in best or r[key] > best[k][key]:
                best[k] = r
    lines = [
        f"# wanxfer vs peers ({mode} run, {started:%Y-%m-%d %H:%M} UTC)",
        "",
        f"Machine: {mach['nproc']} cores ({mach['cpu']}), {mach['mem_gib']:.0f} GiB RAM, Linux {mach['kernel']}.",
        f"Load average (1/5/15 min) before: {mach['load_before']}; after: {mach['load_after']} "
        f"(run from {mach['started']} to {mach['finished']}).",
        f"Command: `{doc['command']}`; repeat {doc.get('repeat', 1)}, timeout {timeout:g}s per run; loopback, "
        f"tmpfs to tmpfs ({mach.get('destination', 'destination: a directory in /dev/shm')}).",
        *([mach["page_reporting"] + "."] if "page_reporting" in mach else []),
        "Versions: " + "; ".join(f"{t}: {v}" for t, v in doc["versions"].items()) + ".",
        "",
        "Gbit/s and files/s use the harness's wall clock around each client (until the receiver has exited for "
        "tar | socat). CPU s = user+system seconds from the kernel: client by wait4 rusage, server as the "
        "/proc delta of a fresh server process tree (see bench/README.md). Client = sender, server = receiver. "
        "Each row is the best verified run over the knob settings tried (all runs are listed at the end).",
        "",
    ]
    for wl in wls:
        lines += [f"## {describe_wl(wl, size)}", "",
                  "| tool | best knobs | Gbit/s | files/s | sender CPU s | receiver CPU s | sender s/GB | "
                  "receiver s/GB | verified | wanxfer / this |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        key = "files_per_s" if wl == "small4" else "gbit"
        wbest = best.get(("wanxfer", wl))
        peer_vals = [best[(t, wl)][key] for t in tools if t != "wanxfer" and (t, wl) in best]
        for tool in tools:
            r = best.get((tool, wl))
            tried = [x for x in runs if x["tool"] == tool and x["workload"] == wl]
            if r:
                gb = r["bytes"] / 1e9
                ratio = f"{wbest[key] / r[key]:.2f}" if wbest and tool != "wanxfer" else "-"
                files = rate(r["files_per_s"]) if r["files"] else "-"
                lines.append(
                    f"| {TOOL_NAMES[tool]} | `{r['knobs']}` | {r['gbit']:.2f} | {files} | {r['client_cpu_s']:.2f} | "
                    f"{r['server_cpu_s']:.2f} | {r['client_cpu_s'] / gb:.3f} | {r['server_cpu_s'] / gb:.3f} | "
                    f"yes | {ratio} |")
            elif tried:
                why = tried[-1].get("error") or tried[-1].get("note", "")
                why = why.replace("|", "/").replace("\n", " ")[:160]
                lines.append(f"| {TOOL_NAMES[tool]} | all tried | FAILED | | | | | | no | {why} |")
            elif (tool, wl) in status:
                lines.append(f"| {TOOL_NAMES[tool]} | | {status[(tool, wl)]} | | | | | | | |")
        if wbest and peer_vals:
            lines += ["", f"wanxfer / best peer ({'files/s' if key == 'files_per_s' else 'Gbit/s'}): "
                          f"**{wbest[key] / max(peer_vals):.2f}**"]
        lines.append("")
    lines += ["## Targets (issue #3)", "", "| target | verdict | numbers |", "|---|---|---|"]
    targets = evaluate(best)
    doc["targets"] = [{"target": t, "verdict": v, "numbers": d} for t, v, d in targets]
    lines += [f"| {t} | {v} | {d} |" for t, v, d in targets]
    lines += ["", "## Every run", "", "| workload | tool | knobs | Gbit/s | files/s | sender CPU s | receiver CPU s | "
              "verified | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if "gbit" in r:
            lines.append(f"| {r['workload']} | {r['tool']} | `{r['knobs']}` | {r['gbit']:.2f} | "
                         f"{rate(r['files_per_s']) if r['files'] else '-'} "
                         f"| {r['client_cpu_s']:.2f} | {r['server_cpu_s']:.2f} | "
                         f"{'yes' if r['verified'] else 'FAILED'} | {r['note'][:120].replace('|', '/')} |")
        else:
            err = r["error"].replace("|", "/").replace("\n", " ")[:200]
            lines.append(f"| {r['workload']} | {r['tool']} | `{r['knobs']}` | FAILED | | | | no | {err} |")
    return "\n".join(lines) + "\n"


def rerender(path):
    with open(path) as f:
        doc = json.load(f)
    text = render(doc)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    md = path[: -len(".json")] + ".md"
    with open(md, "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
