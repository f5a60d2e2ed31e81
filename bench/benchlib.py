"""Shared helpers for the wanxfer benchmarks (quick.py, peers.py). Python 3.11, stdlib only.

CPU accounting (one method for every tool, client and server alike): the kernel's own
per-process counters.
- client: the process the harness starts (a shell for pipelines) is reaped with wait4, whose
  rusage covers it and every descendant it waited for (user + system seconds);
- server: a fresh server per run; CPU = (utime + stime + cutime + cstime) summed over the
  server process and all its live descendants from /proc, after the run minus before it
  (forked per-connection children are counted alive, or in the parent's cutime/cstime once
  reaped). A server that exits by itself (iperf3 -s -1, a socat | tar receiver) is reaped
  with wait4 instead, minus what it had used before the client started.
"""
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLK = os.sysconf("SC_CLK_TCK")
# Cargo's own rule: $CARGO_TARGET_DIR when set (each engineer's build has its own), else
# target/ in the workspace.
TARGET = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
WANXFER = os.path.join(TARGET, "release", "wanxfer")
# At least 16 bytes: wanxfer refuses weaker secrets.
SECRET_ENV = {"WANXFER_SECRET": "bench-secret-0123456789abcdef"}


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)


def build_wanxfer():
    sh(["cargo", "build", "--release", "-q", "-p", "wanxfer"], cwd=ROOT)
    return WANXFER


def wanxfer_env():
    return dict(os.environ, **SECRET_ENV)


def _stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def proc_cpu(pid):
    """User and system CPU seconds of a live process (all its threads)."""
    fields = _stat(pid)
    return int(fields[11]) / CLK, int(fields[12]) / CLK


def _children():
    """Map pid -> list of child pids, from /proc."""
    kids = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            ppid = int(_stat(d)[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    return kids


def tree_pids(pid):
    kids = _children()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def tree_cpu(pid):
    """CPU seconds (user+sys, including reaped children) of a process and its live descendants."""
    total = 0.0
    for p in tree_pids(pid):
        try:
            f = _stat(p)
        except OSError:
            continue
        total += sum(int(x) for x in f[11:15]) / CLK
    return total


class ToolError(RuntimeError):
    pass


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port, timeout=10.0, proc=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise ToolError(f"server exited early ({proc.returncode})")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise ToolError(f"nothing listening on port {port} after {timeout}s")


def run_client(cmd, env=None, timeout=None, shell=False):
    """Runs a client to completion; returns (stdout, cpu_s, wall_s). Kills it on timeout."""
    start = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         shell=shell, start_new_session=True)
    timer_end = None if timeout is None else start + timeout
    # Drain pipes in the background so a chatty client cannot block on a full pipe.
    import threading

    buf = {"out": "", "err": ""}

    def drain(name, f):
        buf[name] = f.read()

    ts = [threading.Thread(target=drain, args=("out", p.stdout)), threading.Thread(target=drain, args=("err", p.stderr))]
    for t in ts:
        t.start()
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if timer_end is not None and time.monotonic() > timer_end:
            kill_group(p)
            pid, status, ru = os.wait4(p.pid, 0)
            for t in ts:
                t.join(2)
            raise ToolError(f"TIMEOUT after {timeout}s: {cmd if isinstance(cmd, str) else ' '.join(cmd)}")
        time.sleep(0.01)
    wall = time.monotonic() - start
    for t in ts:
        t.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        err = (buf["err"].strip() or buf["out"].strip())[-400:]
        raise ToolError(f"exit {p.returncode}: {err}")
    return buf["out"], ru.ru_utime + ru.ru_stime, wall


def kill_group(p, sig=signal.SIGKILL):
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


class Server:
    """A fresh server per run, in its own process group; CPU measured as described above."""

    def __init__(self, cmd, port=None, env=None, shell=False, ready=None, stdout=subprocess.DEVNULL, wait=True,
                 stderr=subprocess.DEVNULL):
        self.p = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, env=env, shell=shell,
                                  start_new_session=True)
        self.line = None
        self.reaped = None
        if ready is not None:
            self.line = ready(self.p)
        elif port is not None and wait:
            wait_port(port, proc=self.p)
        self.mark()

    def mark(self):
        """Starts the CPU count now (call once the server is ready)."""
        self.before = tree_cpu(self.p.pid)

    def cpu(self, settle=2.0):
        """Server CPU seconds used since start(-up ready). Waits up to `settle` s for forked children."""
        if self.reaped is not None:
            return self.reaped - self.before
        end = time.monotonic() + settle
        while len(tree_pids(self.p.pid)) > 1 and time.monotonic() < end:
            time.sleep(0.02)
        return tree_cpu(self.p.pid) - self.before

    def wait_exit(self, timeout):
        """For servers that exit on their own; returns exit code and records rusage."""
        end = time.monotonic() + timeout
        while True:
            pid, status, ru = os.wait4(self.p.pid, os.WNOHANG)
            if pid:
                self.reaped = ru.ru_utime + ru.ru_stime
                self.p.returncode = os.waitstatus_to_exitcode(status)
                return self.p.returncode
            if time.monotonic() > end:
                kill_group(self.p)
                raise ToolError(f"TIMEOUT: server did not finish within {timeout}s")
            time.sleep(0.01)

    def stop(self):
        if self.p.returncode is None and self.reaped is None:
            kill_group(self.p, signal.SIGTERM)
            try:
                self.p.wait(3)
            except subprocess.TimeoutExpired:
                kill_group(self.p)
                self.p.wait()
        kill_group(self.p)  # forked leftovers


def wanxfer_server(binary, root, env, flags=(), stderr=subprocess.DEVNULL):
    def ready(p):
        line = p.stdout.readline()
        m = re.search(r"on (127\.0\.0\.1:\d+)$", line.strip())
        if not m:
            raise RuntimeError(f"server did not start: {line!r}")
        return m.group(1)

    return Server([binary, "serve", "--root", root, "--listen", "127.0.0.1:0", *flags], env=env, ready=ready,
                  stdout=subprocess.PIPE, stderr=stderr)


def compare_trees(a, b):
    """Byte-for-byte comparison of two trees: names, types, sizes, symlink targets, contents.
    Returns (ok, files_compared, first_difference)."""
    n = 0
    for dirpath, dirnames, filenames in os.walk(a):
        rel = os.path.relpath(dirpath, a)
        other = os.path.normpath(os.path.join(b, rel))
        try:
            theirs = set(os.listdir(other))
        except OSError as e:
            return False, n, f"{rel}: {e}"
        mine = set(dirnames) | set(filenames)
        if mine != theirs:
            diff = sorted(mine ^ theirs)[:3]
            return False, n, f"{rel}: entries differ {diff}"
        for name in filenames:
            pa, pb = os.path.join(dirpath, name), os.path.join(other, name)
            if os.path.islink(pa):
                if not os.path.islink(pb) or os.readlink(pa) != os.readlink(pb):
                    return False, n, f"{rel}/{name}: symlink differs"
                continue
            sa, sb = os.stat(pa), os.lstat(pb)
            if sa.st_size != sb.st_size:
                return False, n, f"{rel}/{name}: size {sa.st_size} != {sb.st_size}"
            with open(pa, "rb") as fa, open(pb, "rb") as fb:
                while True:
                    x = fa.read(1 << 20)
                    if x != fb.read(1 << 20):
                        return False, n, f"{rel}/{name}: contents differ"
                    if not x:
                        break
            n += 1
    return True, n, ""


def tree_stats(path):
    files = byts = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            files += 1
            byts += os.lstat(os.path.join(dirpath, name)).st_size
    return files, byts


def line_rate(line):
    """A --progress-json line's rate in bit/s: what the data sockets delivered
    (`network_bits_per_s`) where the client sampled them, else the block count
    (`bits_per_s`, which steps by whole 4 MiB blocks)."""
    network = line.get("network_bits_per_s")
    return line["bits_per_s"] if network is None else network


def best(runs, key="gbit"):
    return max(runs, key=lambda r: r[key])


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def mem_gib():
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def machine():
    return f"{os.cpu_count()} cores ({cpu_model()}), {mem_gib():.0f} GiB RAM, Linux {platform.release()}"


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def parse_size(s):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)", s.strip(), re.I)
    if not m:
        raise ValueError(f"bad size {s!r}")
    n, unit, suffix = float(m.group(1)), m.group(2).upper(), m.group(3).lower()
    base = 1000 if suffix == "b" and unit else 1024
    return int(n * base ** " KMGT".index(unit or " "))


class DestTmpfs:
    """The destination file system of a benchmark: a tmpfs of its own, mounted with
    `huge=within_size` when the harness runs as root, the same for every tool.

    `within_size` gives a file huge pages only where its size already covers them, so a
    tool that announces the size first (wanxfer reserves it) gets them and one that appends
    does not; small files never waste a 2 MiB page. Without root the destination is a
    directory in /dev/shm and `describe()` says so. While it is mounted, the host's page
    reporting is paused (`HostPageReporting`), so that no run pays for memory the host took.
    """

    def __init__(self, parent, size_gib=14, warm_gib=8):
        self.path = os.path.join(parent, "dst-fs")
        os.makedirs(self.path, exist_ok=True)
        self.mounted = False
        if os.geteuid() == 0:
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"huge=within_size,size={size_gib}G,mode=0755",
                                "wanxfer-bench", self.path], capture_output=True, text=True)
            self.mounted = r.returncode == 0
            why = "" if self.mounted else f": mount failed: {r.stderr.strip()}"
        else:
            why = ": mounting huge=within_size needs root"
        self.description = ("destination: a tmpfs of its own mounted with huge=within_size" if self.mounted
                            else f"destination: a directory in /dev/shm (plain tmpfs{why})")
        try:
            self.reporting = HostPageReporting(self.path, warm_gib)
        except BaseException:
            self._unmount()
            raise

    def describe(self):
        return self.description

    def close(self):
        self.reporting.close()
        self._unmount()

    def _unmount(self):
        if self.mounted:
            subprocess.run(["umount", "-l", self.path], capture_output=True)
            self.mounted = False


class HostPageReporting:
    """Keeps the guest's freed memory out of the hypervisor's hands while the tools run.

    With free page reporting (virtio-balloon) the guest hands blocks it has freed back to
    the host a second or two later; the next write into such a page faults in the host.
    On the VM these runs were made on that costs about 3 CPU s per GiB written (dd of
    2 GiB into tmpfs: 6.3 s after the memory had been free for a few seconds, 0.2 s right
    after), which is ten times what any tool here spends per GiB. Which run pays it
    depends on how long memory sat free before it, so it scrambles a side-by-side
    comparison. Raising `page_reporting_order` past the largest buddy order (10) leaves
    nothing large enough to report; writing and deleting `warm_gib` of data then faults
    the already-reported memory back once, before any run. The old order is restored
    on `close()`. Without the parameter (bare metal, no balloon) this does nothing;
    where the kernel refuses the value, `describe()` says so.
    """

    PARAM = "/sys/module/page_reporting/parameters/page_reporting_order"
    NEVER = "11"

    def __init__(self, warm_dir, warm_gib):
        self.saved = None
        if not os.path.exists(self.PARAM):
            self.description = "Host page reporting: not present"
            return
        try:
            with open(self.PARAM) as f:
                saved = f.read().strip()
            with open(self.PARAM, "w") as f:
                f.write(self.NEVER)
            self.saved = saved
        except OSError as e:
            self.description = (f"Host page reporting: ACTIVE ({e.strerror}); runs after an idle pause "
                                "pay host faults of about 3 CPU s per GiB written")
            return
        try:
            warmed = self._warm(warm_dir, warm_gib)
        except BaseException:
            # Ctrl-C or a full disk before the caller holds this object: restore now.
            self.close()
            raise
        self.description = (f"Host page reporting: paused during the runs (page_reporting_order "
                             f"{saved} -> {self.NEVER}, restored after); {warmed:.1f} GiB of free memory "
                             "faulted back in first")
        print(self.description, flush=True)

    @staticmethod
    def _warm(warm_dir, warm_gib):
        """Writes and deletes up to `warm_gib` GiB (at most half of what is available)."""
        with open("/proc/meminfo") as f:
            avail_kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable:"))
        gib = min(warm_gib, avail_kib / 2**20 / 2)
        path = os.path.join(warm_dir, "page-reporting-warmup")
        chunk = b"\0" * (1 << 20)
        try:
            with open(path, "wb") as f:
                for _ in range(int(gib * 1024)):
                    f.write(chunk)
        finally:
            os.unlink(path)
        return gib

    def describe(self):
        return self.description

    def close(self):
        if self.saved is not None:
            with open(self.PARAM, "w") as f:
                f.write(self.saved)
            self.saved = None
