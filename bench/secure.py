#!/usr/bin/env python3
"""wanxfer encrypted (TLS 1.3, the default) against the encrypted movers people use, on
loopback, and against the cipher's floor (issue 18, "Benchmarks").

Every peer here protects every byte in transit; none runs in a weakened mode:
  ssh      `head -c N /dev/zero | ssh -c aes128-gcm@openssh.com host 'wc -c'` (memory only)
  rsync    rsync -a -W over that ssh
  scp      scp -r over that ssh (OpenSSH 9: the SFTP protocol; `-O` the legacy one)
  sftp     sftp -b with `put -r` over that ssh
  gridftp  globus-url-copy -dcpriv (GSI on control and data channels, data encrypted)
  xrootd   xrdcp to roots:// (xrootd.tls all: login, session and data over TLS 1.3)
References, not peers:
  wanxfer-plain  wanxfer --no-encryption (its frames still carry a MAC)
  floor          examples/tls_floor.rs --floor-only: one thread seals 16 KiB AES-128-GCM
                 records (TLS's record size, rustls's cipher) and writes them to loopback
                 TCP, another reads and opens them; nothing else. Memory only.

A throwaway CA (openssl) issues the host certificate that wanxfer, GridFTP and XRootD
present, and the user certificate GridFTP's proxy is made from; a throwaway sshd on a
loopback port has its own host key and authorized key; all in a temporary directory that
is removed at the end. Workloads: memory to memory (default 8 GiB) and 20,000 x 64 KiB
files in 100 directories; every tree is compared byte for byte afterwards. Runs alternate:
each round runs every tool and knob setting once, so slow drift in the machine's load hits
all tools alike; the best verified run per tool is reported, and the load average is
recorded with every run (the machine is shared). CPU accounting as in peers.py
(bench/benchlib.py): client = sender, server = receiver.

usage: bench/secure.py [--quick] [--mem-bytes SIZE] [--small-count N] [--only TOOL,...]
                       [--workloads mem,small64] [--repeat N] [--timeout S] [--tag T]
       bench/secure.py --render bench/runs/secure-DATE.json
"""
import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (  # noqa: E402
    ROOT, TARGET, DestTmpfs, Server, ToolError, build_wanxfer, compare_trees, cpu_model, free_port, loadavg,
    mem_gib, parse_size, run_client, tree_stats, wanxfer_env, wanxfer_server,
)

GIB = 1 << 30
SIZES = {"full": {"mem": 8 * GIB, "small64": 20000}, "quick": {"mem": 1 * GIB, "small64": 2000}}
WORKLOADS = ["mem", "small64"]
PEERS = ["ssh", "rsync", "scp", "sftp", "gridftp", "xrootd"]
TOOLS = ["wanxfer", "wanxfer-plain", "floor", *PEERS]
TOOL_NAMES = {
    "wanxfer": "wanxfer (TLS 1.3)",
    "wanxfer-plain": "wanxfer --no-encryption",
    "floor": "floor: AES-128-GCM records over TCP",
    "ssh": "ssh aes128-gcm pipe",
    "rsync": "rsync over ssh aes128-gcm",
    "scp": "scp aes128-gcm",
    "sftp": "sftp aes128-gcm",
    "gridftp": "globus-url-copy -dcpriv",
    "xrootd": "xrdcp roots://",
}
BINARIES = {
    "ssh": ["ssh", "/usr/sbin/sshd"], "rsync": ["rsync", "ssh", "/usr/sbin/sshd"],
    "scp": ["scp", "/usr/sbin/sshd"], "sftp": ["sftp", "/usr/sbin/sshd"],
    "gridftp": ["globus-url-copy", "globus-gridftp-server", "grid-proxy-init"], "xrootd": ["xrdcp", "xrootd"],
}
CIPHER = "aes128-gcm@openssh.com"
KNOBS = {
    # mem: 1 stream is wanxfer's best on loopback (bench/README.md, stop 13); 64 KiB files: 2.
    "wanxfer": {"mem": [["--streams", "1", "--block-size", "4MiB"], ["--streams", "2", "--block-size", "4MiB"]],
                "small64": [["--streams", "2", "--block-size", "1MiB"], ["--streams", "1", "--block-size", "1MiB"]]},
    "wanxfer-plain": {"mem": [["--streams", "1", "--block-size", "4MiB"]],
                      "small64": [["--streams", "2", "--block-size", "1MiB"]]},
    "floor": {"mem": [[]]},
    "ssh": {"mem": [[]]},
    "rsync": {"small64": [["-W"]]},
    "scp": {"small64": [[], ["-O"]]},
    "sftp": {"small64": [[]]},
    "gridftp": {"mem": [["-dcpriv", "-fast"], ["-dcpriv", "-fast", "-p", "2"], ["-dcpriv", "-fast", "-p", "4"]],
                # -cc 16 ran at half -cc 4's rate here (each connection is a GSI handshake).
                "small64": [["-dcpriv", "-fast", "-pp", "-cc", "2"], ["-dcpriv", "-fast", "-pp", "-cc", "4"]]},
    "xrootd": {"small64": [["--parallel", "4"], ["--parallel", "16"]]},
}
UNSUPPORTED = {
    ("xrootd", "mem"): "xrootd has no memory sink: xrdcp - to //dev/null fails with "
                       "'[3015] Unable to open /dev/null; block device required'",
    ("rsync", "mem"): "no memory-to-memory mode; SSH's own is the ssh row",
    ("scp", "mem"): "copies regular files only; SSH's own memory to memory is the ssh row",
    ("sftp", "mem"): "copies regular files only; SSH's own memory to memory is the ssh row",
    ("ssh", "small64"): "a pipe, not a file copier (rsync, scp and sftp are the SSH rows)",
    ("floor", "small64"): "the floor is memory to memory only",
}


def sh(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise ToolError(f"{' '.join(cmd)}: exit {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}")
    return r.stdout


class Credentials:
    """A throwaway CA and everything the encrypted tools need, in `dir` (removed by the caller).

    Host certificate: CN=localhost with SANs localhost and 127.0.0.1, so wanxfer (which
    connects to 127.0.0.1 and checks the IP), GridFTP (which checks CN=localhost) and
    XRootD all verify it against the CA. GSI wants the CA in an OpenSSL hashed directory
    with a signing policy, and a proxy certificate made from the user's.
    """

    def __init__(self, work):
        d = self.dir = os.path.join(work, "creds")
        os.makedirs(d)
        os.chmod(d, 0o755)
        j = lambda *p: os.path.join(d, *p)  # noqa: E731
        self.ca, self.host_cert, self.host_key = j("ca.pem"), j("host.pem"), j("host.key")
        self.user_cert, self.user_key, self.proxy = j("user.pem"), j("user.key"), j("proxy.pem")
        self.cadir, self.gridmap = j("cadir"), j("gridmap")
        sh(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", j("ca.key"), "-out", self.ca,
            "-days", "2", "-subj", "/O=wanxfer-bench/CN=wanxfer bench CA",
            "-addext", "basicConstraints=critical,CA:true", "-addext", "keyUsage=critical,keyCertSign,cRLSign"])
        for name, cn, ext in (
            ("host", "localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"),
            ("user", "bench user", "extendedKeyUsage=clientAuth\n"),
        ):
            sh(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", j(f"{name}.key"), "-out",
                j(f"{name}.csr"), "-subj", f"/O=wanxfer-bench/CN={cn}"])
            with open(j(f"{name}.ext"), "w") as f:
                f.write("basicConstraints=CA:false\nkeyUsage=critical,digitalSignature,keyEncipherment\n" + ext)
            sh(["openssl", "x509", "-req", "-in", j(f"{name}.csr"), "-CA", self.ca, "-CAkey", j("ca.key"),
                "-CAcreateserial", "-out", j(f"{name}.pem"), "-days", "2", "-extfile", j(f"{name}.ext")])
            os.chmod(j(f"{name}.key"), 0o600)
        os.makedirs(self.cadir)
        h = sh(["openssl", "x509", "-hash", "-noout", "-in", self.ca]).strip()
        shutil.copy(self.ca, os.path.join(self.cadir, f"{h}.0"))
        with open(os.path.join(self.cadir, f"{h}.signing_policy"), "w") as f:
            f.write("access_id_CA X509 '/O=wanxfer-bench/CN=wanxfer bench CA'\npos_rights globus CA:sign\n"
                    "cond_subjects globus '\"/O=wanxfer-bench/*\"'\n")
        # xrootd drops to 'nobody' before it reads its key; GSI wants its own user's files.
        self.xrd_cert, self.xrd_key = j("xrootd-host.pem"), j("xrootd-host.key")
        for a, b in ((self.host_cert, self.xrd_cert), (self.host_key, self.xrd_key)):
            shutil.copy(a, b)
            os.chown(b, _uid("nobody"), -1)
        # GridFTP refuses logins mapped to root, so the user is 'nobody' (destinations are 0777).
        with open(self.gridmap, "w") as f:
            f.write('"/O=wanxfer-bench/CN=bench user" nobody\n')
        self.ssh_host_key, self.ssh_user_key = j("ssh_host_key"), j("ssh_user_key")
        self.authorized, self.known_hosts = j("authorized_keys"), j("known_hosts")
        for k in (self.ssh_host_key, self.ssh_user_key):
            sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", k])
        shutil.copy(self.ssh_user_key + ".pub", self.authorized)
        self.proxy_made = None

    def make_proxy(self):
        """GridFTP's client credential: a proxy from the user certificate, made once."""
        if self.proxy_made is None:
            sh(["grid-proxy-init", "-cert", self.user_cert, "-key", self.user_key, "-out", self.proxy, "-rfc"],
               env=dict(os.environ, X509_CERT_DIR=self.cadir))
            self.proxy_made = True

    def gsi_client_env(self):
        return dict(os.environ, X509_CERT_DIR=self.cadir, X509_USER_PROXY=self.proxy)

    def gsi_server_env(self):
        return dict(os.environ, X509_CERT_DIR=self.cadir, X509_USER_CERT=self.host_cert,
                    X509_USER_KEY=self.host_key, GRIDMAP=self.gridmap)


def _uid(name):
    import pwd
    return pwd.getpwnam(name).pw_uid


class Ctx:
    def __init__(self, work, binary, floor, timeout, dest_fs, creds):
        self.work, self.binary, self.floor, self.timeout, self.creds = work, binary, floor, timeout, creds
        self.env = dict(wanxfer_env(), WANXFER_STATE_DIR=os.path.join(work, "wanxfer-state"))
        self.dst = os.path.join(dest_fs.path, "dst")


def fresh_dst(ctx):
    shutil.rmtree(ctx.dst, ignore_errors=True)
    os.makedirs(ctx.dst)
    os.chmod(ctx.dst, 0o777)  # gridftp and xrootd write as 'nobody'
    return ctx.dst


# ---- servers -------------------------------------------------------------------------------

def wanxfer_srv(ctx, root, plain):
    c = ctx.creds
    flags = ["--cert", c.host_cert, "--key", c.host_key, *(["--allow-unencrypted"] if plain else [])]
    return wanxfer_server(ctx.binary, root, ctx.env, flags)


def wanxfer_client_flags(ctx, plain):
    return ["--no-encryption"] if plain else ["--ca", ctx.creds.ca]


def sshd(ctx):
    c, port = ctx.creds, free_port()
    cfg = os.path.join(ctx.work, "sshd_config")
    with open(cfg, "w") as f:
        f.write(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {c.ssh_host_key}\nAuthorizedKeysFile {c.authorized}\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                f"StrictModes no\nUsePAM no\nPidFile none\nCiphers {CIPHER}\nCompression no\n"
                "Subsystem sftp internal-sftp\nLogLevel ERROR\n")
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
    with open(c.known_hosts, "w") as f, open(c.ssh_host_key + ".pub") as k:
        f.write(f"[127.0.0.1]:{port} {k.read()}")
    srv = Server(["/usr/sbin/sshd", "-D", "-e", "-f", cfg], port=port)
    opts = ["-F", "/dev/null", "-o", f"Port={port}", "-i", c.ssh_user_key, "-o", f"UserKnownHostsFile={c.known_hosts}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-c", CIPHER, "-o", "Compression=no"]
    return srv, opts


def gridftp_srv(ctx):
    port = free_port()
    srv = Server(["globus-gridftp-server", "-p", str(port), "-d", "error"], port=port, env=ctx.creds.gsi_server_env())
    return srv, port


def xrootd_srv(ctx, root):
    port = free_port()
    c = ctx.creds
    cfg = os.path.join(ctx.work, "xrootd.cfg")
    admin = os.path.join(ctx.work, "xrd-admin")
    os.makedirs(admin, exist_ok=True)
    os.chmod(admin, 0o777)
    with open(cfg, "w") as f:
        f.write(f"all.export {root}\nxrd.port {port}\nall.adminpath {admin}\nall.pidpath {admin}\n"
                f"xrd.tls {c.xrd_cert} {c.xrd_key}\nxrd.tlsca certdir {c.cadir}\nxrootd.tls all\n")
    return Server(["xrootd", "-c", cfg, "-l", os.path.join(admin, "xrootd.log"), "-R", "nobody"], port=port), port


# ---- memory to memory ---------------------------------------------------------------------

def result(byts, files, wall, ccpu, scpu, verified, note=""):
    return {"bytes": byts, "files": files, "seconds": wall, "gbit": byts * 8 / wall / 1e9,
            "files_per_s": files / wall if files else 0.0, "client_cpu_s": ccpu, "server_cpu_s": scpu,
            "verified": verified, "note": note}


def wanxfer_note(r):
    return (f"wanxfer reports {r['gbit_per_s']:.2f} Gbit/s, encryption {r.get('encryption', '?')}, "
            f"records {r.get('tls_records', '?')}, io {r.get('io', '?')}")


def mem_wanxfer(ctx, n, knobs, plain=False):
    srv = wanxfer_srv(ctx, fresh_dst(ctx), plain)
    try:
        out, ccpu, wall = run_client([ctx.binary, "cp", "--json", *wanxfer_client_flags(ctx, plain), *knobs,
                                      "--bytes", str(n), "/dev/zero", f"wanxfer://{srv.line}/dev/null"],
                                     env=ctx.env, timeout=ctx.timeout)
        r = json.loads(out)
        res = result(n, 0, wall, ccpu, srv.cpu(), r["bytes"] == n, wanxfer_note(r))
        res["self_gbit"] = r["gbit_per_s"]
        return res
    finally:
        srv.stop()


def mem_floor(ctx, n, knobs):
    gib = -(-n // GIB)
    out, _, wall = run_client([ctx.floor, str(gib), "--floor-only"], timeout=ctx.timeout)
    m = re.search(r"floor: ([\d.]+) Gbit/s, sender ([\d.]+) CPU s/GB, receiver ([\d.]+) CPU s/GB", out)
    if not m:
        raise ToolError(f"tls_floor printed no floor line: {out[-200:]!r}")
    gb = (gib * GIB) / 1e9
    # Its own clock and per-thread CPU: the loop alone, no process start or key set-up.
    res = result(gib * GIB, 0, wall, float(m.group(2)) * gb, float(m.group(3)) * gb, True,
                 f"own clock {m.group(1)} Gbit/s; CPU per thread")
    res["gbit"] = res["self_gbit"] = float(m.group(1))
    return res


def mem_ssh(ctx, n, knobs):
    srv, opts = sshd(ctx)
    try:
        cmd = f"head -c {n} /dev/zero | ssh {shlex.join(opts + knobs)} 127.0.0.1 'wc -c'"
        out, ccpu, wall = run_client(cmd, shell=True, timeout=ctx.timeout)
        got = int(out.split()[0]) if out.split() else -1
        return result(n, 0, wall, ccpu, srv.cpu(), got == n, f"receiver counted {got} bytes")
    finally:
        srv.stop()


def mem_gridftp(ctx, n, knobs):
    ctx.creds.make_proxy()
    srv, port = gridftp_srv(ctx)
    try:
        out, ccpu, wall = run_client(["globus-url-copy", "-vb", *knobs, "-len", str(n), "file:///dev/zero",
                                      f"gsiftp://localhost:{port}/dev/null"], env=ctx.creds.gsi_client_env(),
                                     timeout=ctx.timeout)
        counted = [int(w.split()[0]) for w in out.replace("\r", "\n").splitlines() if w.strip().endswith("inst")]
        got = counted[-1] if counted else -1
        return result(n, 0, wall, ccpu, srv.cpu(), got == n, f"client counted {got} bytes")
    finally:
        srv.stop()


# ---- files ----------------------------------------------------------------------------------

def files_wanxfer(ctx, src, knobs, plain=False):
    root = fresh_dst(ctx)
    srv = wanxfer_srv(ctx, root, plain)
    try:
        out, ccpu, wall = run_client([ctx.binary, "cp", "--json", *wanxfer_client_flags(ctx, plain), *knobs, src,
                                      f"wanxfer://{srv.line}/out"], env=ctx.env, timeout=ctx.timeout)
        r = json.loads(out)
        return ccpu, wall, srv.cpu(), os.path.join(root, "out"), wanxfer_note(r), r["gbit_per_s"]
    finally:
        srv.stop()


def files_rsync(ctx, src, knobs):
    root = fresh_dst(ctx)
    srv, opts = sshd(ctx)
    try:
        _, ccpu, wall = run_client(["rsync", "-a", *knobs, "-e", "ssh " + shlex.join(opts), f"{src}/",
                                    f"127.0.0.1:{root}/out/"], timeout=ctx.timeout)
        return ccpu, wall, srv.cpu(), os.path.join(root, "out"), ""
    finally:
        srv.stop()


def files_scp(ctx, src, knobs):
    root = fresh_dst(ctx)
    srv, opts = sshd(ctx)
    try:
        _, ccpu, wall = run_client(["scp", "-r", "-q", *knobs, *opts, src, f"127.0.0.1:{root}/out"],
                                   timeout=ctx.timeout)
        note = "legacy scp protocol" if "-O" in knobs else "SFTP protocol (OpenSSH 9 default)"
        return ccpu, wall, srv.cpu(), os.path.join(root, "out"), note
    finally:
        srv.stop()


def files_sftp(ctx, src, knobs):
    root = fresh_dst(ctx)
    srv, opts = sshd(ctx)
    batch = os.path.join(ctx.work, "sftp-batch")
    with open(batch, "w") as f:
        f.write(f"put -r {src} {root}/out\n")
    try:
        _, ccpu, wall = run_client(["sftp", "-q", "-b", batch, *knobs, *opts, "127.0.0.1"], timeout=ctx.timeout)
        return ccpu, wall, srv.cpu(), os.path.join(root, "out"), ""
    finally:
        srv.stop()


def files_gridftp(ctx, src, knobs):
    ctx.creds.make_proxy()
    root = fresh_dst(ctx)
    srv, port = gridftp_srv(ctx)
    try:
        out_dir = os.path.join(root, "out")
        _, ccpu, wall = run_client(["globus-url-copy", "-r", "-cd", *knobs, f"file://{src}/",
                                    f"gsiftp://localhost:{port}{out_dir}/"], env=ctx.creds.gsi_client_env(),
                                   timeout=ctx.timeout)
        return ccpu, wall, srv.cpu(), out_dir, ""
    finally:
        srv.stop()


def files_xrootd(ctx, src, knobs):
    root = fresh_dst(ctx)
    srv, port = xrootd_srv(ctx, root)
    try:
        out_dir = os.path.join(root, "out")
        os.makedirs(out_dir)
        os.chmod(out_dir, 0o777)
        _, ccpu, wall = run_client(["xrdcp", "-r", "-s", *knobs, f"{src}/", f"roots://localhost:{port}/{out_dir}/"],
                                   env=dict(os.environ, X509_CERT_DIR=ctx.creds.cadir), timeout=ctx.timeout)
        return ccpu, wall, srv.cpu(), os.path.join(out_dir, os.path.basename(src)), ""
    finally:
        srv.stop()


MEM = {"wanxfer": mem_wanxfer, "wanxfer-plain": lambda c, n, k: mem_wanxfer(c, n, k, plain=True),
       "floor": mem_floor, "ssh": mem_ssh, "gridftp": mem_gridftp}
FILES = {"wanxfer": files_wanxfer, "wanxfer-plain": lambda c, s, k: files_wanxfer(c, s, k, plain=True),
         "rsync": files_rsync, "scp": files_scp, "sftp": files_sftp, "gridftp": files_gridftp,
         "xrootd": files_xrootd}


def run_one(ctx, tool, wl, knobs, src, src_stats):
    load = loadavg()
    try:
        if wl == "mem":
            r = MEM[tool](ctx, src_stats[1], knobs)
        else:
            ccpu, wall, scpu, out, note, *own = FILES[tool](ctx, src, knobs)
            ok, n, why = compare_trees(src, out) if os.path.isdir(out) else (False, 0, f"{out} missing")
            r = result(src_stats[1], src_stats[0], wall, ccpu, scpu, ok and n == src_stats[0],
                       note if ok else f"verify: {why}")
            if own:
                r["self_gbit"] = own[0]
    except Exception as e:  # noqa: BLE001 - a broken tool must not stop the benchmark
        r = {"verified": False, "error": f"{type(e).__name__}: {e}" if not isinstance(e, ToolError) else str(e)}
    finally:
        shutil.rmtree(ctx.dst, ignore_errors=True)
    r.update(tool=tool, workload=wl, knobs=" ".join(knobs) or "(defaults)", load=load)
    return r


def installed(tool):
    return all(shutil.which(b) for b in BINARIES.get(tool, []))


def version(tool, ctx_binary):
    cmds = {"wanxfer": [ctx_binary, "--version"], "ssh": ["ssh", "-V"], "rsync": ["rsync", "--version"],
            "gridftp": ["globus-url-copy", "-version"], "xrootd": ["xrdcp", "--version"]}
    if tool not in cmds:
        return None
    try:
        p = subprocess.run(cmds[tool], capture_output=True, text=True, timeout=10)
        lines = [ln.strip() for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
        return lines[0] if lines else "?"
    except Exception as e:  # noqa: BLE001
        return f"? ({e})"


def build_floor():
    subprocess.run(["nice", "cargo", "build", "--release", "-q", "-p", "wanxfer-engine", "--example", "tls_floor"],
                   cwd=ROOT, check=True)
    return os.path.join(TARGET, "release", "examples", "tls_floor")


def describe_wl(wl, size):
    return {"mem": f"{size['mem'] / GIB:g} GiB memory to memory, encrypted",
            "small64": f"{size['small64']:,} x 64 KiB in 100 dirs, encrypted"}[wl]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 GiB and 2,000 files: a smoke test")
    ap.add_argument("--mem-bytes", help="memory-to-memory size (default 8GiB; whole GiB for the floor)")
    ap.add_argument("--small-count", type=int, help="64 KiB files (default 20000)")
    ap.add_argument("--only", default=",".join(TOOLS), help="tools to run (comma separated)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--repeat", type=int, default=1, help="rounds; each runs every tool and knob once")
    ap.add_argument("--timeout", type=float, default=300, help="seconds before a run is killed")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "runs"))
    ap.add_argument("--tag", default="", help="suffix for the output file names")
    ap.add_argument("--render", metavar="RUN.json", help="only rewrite RUN.md from a recorded RUN.json")
    a = ap.parse_args()
    if a.render:
        with open(a.render) as f:
            doc = json.load(f)
        text = render(doc)
        with open(a.render[: -len(".json")] + ".md", "w") as f:
            f.write(text)
        print(text)
        return
    if os.geteuid() != 0:
        # sshd needs /run/sshd and its keys' owner; GridFTP maps the user with setuid; xrootd -R.
        sys.exit("bench/secure.py must run as root: it starts sshd, a GridFTP server that changes "
                 "user and xrootd as 'nobody'")
    mode = "quick" if a.quick else "full"
    size = dict(SIZES[mode])
    if a.mem_bytes:
        size["mem"] = parse_size(a.mem_bytes)
    if a.small_count:
        size["small64"] = a.small_count
    reduced = size != SIZES["full"]
    tools = [t for t in a.only.split(",") if t]
    wls = [w for w in a.workloads.split(",") if w]

    binary = build_wanxfer()
    floor = build_floor() if "floor" in tools else None
    load_before = loadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    work = tempfile.mkdtemp(prefix="wanxfer-secure.", dir="/dev/shm")
    os.chmod(work, 0o755)
    runs, status = [], {}
    dest_fs = DestTmpfs(work, warm_gib=4)
    try:
        creds = Credentials(work)
        ctx = Ctx(work, binary, floor, a.timeout, dest_fs, creds)
        for wl in wls:
            src, stats = None, (0, size["mem"])
            if wl == "small64":
                src = os.path.join(work, "src-small64")
                print(f"== generating {describe_wl(wl, size)}", flush=True)
                subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen-dataset.py"), src, "--small-count",
                                str(size["small64"]), "--small-kib", "64", "--dirs", "100"], check=True)
                os.chmod(work, 0o755)
                stats = tree_stats(src)
            plan = []
            for tool in tools:
                if tool in PEERS and not installed(tool):
                    status[(tool, wl)] = "not installed (scripts/install-bench-deps.sh)"
                elif (tool, wl) in UNSUPPORTED:
                    status[(tool, wl)] = "not measured: " + UNSUPPORTED[(tool, wl)]
                else:
                    plan += [(tool, k) for k in KNOBS[tool].get(wl, [])]
            for _ in range(a.repeat):
                for tool, knobs in plan:
                    r = run_one(ctx, tool, wl, knobs, src, stats)
                    runs.append(r)
                    if r.get("error"):
                        msg = f"FAILED {r['error']}"
                    elif not r["verified"]:
                        msg = f"FAILED verification: {r['note']}"
                    else:
                        msg = (f"{r['gbit']:.2f} Gbit/s cpu client {r['client_cpu_s']:.2f}s "
                               f"server {r['server_cpu_s']:.2f}s")
                    print(f"{wl:8} {tool:14} {r['knobs']:34} {msg}  (load {r['load']})", flush=True)
            if src:
                shutil.rmtree(src, ignore_errors=True)
    finally:
        dest_fs.close()
        shutil.rmtree(work, ignore_errors=True)
    finished = datetime.datetime.now(datetime.timezone.utc)
    versions = {t: v for t in tools if (v := version(t, binary))}
    versions["openssl"] = subprocess.run(["openssl", "version"], capture_output=True, text=True).stdout.strip()
    mach = {"nproc": os.cpu_count(), "cpu": cpu_model(), "mem_gib": round(mem_gib(), 1),
            "aes_ni": "aes" in open("/proc/cpuinfo").read().split(), "vaes": "vaes" in open("/proc/cpuinfo").read().split(),
            "kernel": os.uname().release, "load_before": load_before, "load_after": loadavg(),
            "started": started.isoformat(timespec="seconds"), "finished": finished.isoformat(timespec="seconds"),
            "destination": dest_fs.describe(), "page_reporting": dest_fs.reporting.describe()}
    doc = {"command": "bench/secure.py " + " ".join(sys.argv[1:]), "machine": mach, "versions": versions,
           "sizes": size, "reduced": reduced, "repeat": a.repeat, "timeout": a.timeout, "tools": tools,
           "workloads": wls, "runs": runs, "status": {f"{t}/{w}": s for (t, w), s in status.items()}}
    text = render(doc)
    print(text)
    os.makedirs(a.out_dir, exist_ok=True)
    tag = "-" + a.tag.lstrip("-") if a.tag else ""
    stem = os.path.join(a.out_dir, f"secure-{started:%Y-%m-%d}{'-reduced' if reduced else ''}{tag}")
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {stem}.md and {stem}.json")


def render(doc):
    runs, size, mach = doc["runs"], doc["sizes"], doc["machine"]
    tools, wls = doc["tools"], doc["workloads"]
    status = {tuple(k.split("/", 1)): v for k, v in doc.get("status", {}).items()}
    best = {}
    for r in runs:
        if r.get("verified") and "gbit" in r:
            k = (r["tool"], r["workload"])
            if k not in best or r["gbit"] > best[k]["gbit"]:
                best[k] = r
    started = datetime.datetime.fromisoformat(mach["started"])
    lines = [
        f"# wanxfer encrypted vs encrypted peers ({started:%Y-%m-%d %H:%M} UTC)", "",
        f"Machine: {mach['nproc']} cores ({mach['cpu']}; AES-NI {'yes' if mach['aes_ni'] else 'no'}, "
        f"vector AES {'yes' if mach['vaes'] else 'no'}), {mach['mem_gib']:.0f} GiB RAM, Linux {mach['kernel']}.",
        f"Load average (1/5/15 min) before: {mach['load_before']}; after: {mach['load_after']} (shared machine; "
        "each run's load at its start is in the last table).",
        f"Command: `{doc['command']}`; {doc['repeat']} alternating round(s), timeout {doc['timeout']:g}s per run; "
        f"loopback, tmpfs to tmpfs ({mach['destination']}). {mach['page_reporting']}.",
        *(["**Reduced sizes** (the issue's are 8 GiB and 20,000 files): see the headings."] if doc["reduced"] else []),
        "Versions: " + "; ".join(f"{t}: {v}" for t, v in doc["versions"].items()) + ".", "",
        "Gbit/s: bytes x 8 / the harness's wall clock around the client (process start, key exchange and "
        "authentication included), except the floor's, which is its own loop's. CPU: user+system seconds from the "
        "kernel, client = sender, server = receiver (bench/README.md); the floor's are its two threads'. Each row "
        "is the tool's best verified run.", "",
    ]
    for wl in wls:
        lines += [f"## {describe_wl(wl, size)}", "",
                  "| tool | best knobs | Gbit/s | sender CPU s | receiver CPU s | sender s/GB | receiver s/GB | "
                  "wanxfer / this |", "|---|---|---|---|---|---|---|---|"]
        w = best.get(("wanxfer", wl))
        for tool in tools:
            r = best.get((tool, wl))
            tried = [x for x in runs if x["tool"] == tool and x["workload"] == wl]
            if r:
                gb = r["bytes"] / 1e9
                ratio = f"{w['gbit'] / r['gbit']:.2f}" if w and tool != "wanxfer" else "-"
                lines.append(f"| {TOOL_NAMES[tool]} | `{r['knobs']}` | {r['gbit']:.2f} | {r['client_cpu_s']:.2f} | "
                             f"{r['server_cpu_s']:.2f} | {r['client_cpu_s'] / gb:.3f} | {r['server_cpu_s'] / gb:.3f} | "
                             f"{ratio} |")
            elif tried:
                why = (tried[-1].get("error") or tried[-1].get("note", "")).replace("|", "/").replace("\n", " ")[:200]
                lines.append(f"| {TOOL_NAMES[tool]} | all tried | FAILED | | | | | {why} |")
            elif (tool, wl) in status:
                lines.append(f"| {TOOL_NAMES[tool]} | | {status[(tool, wl)]} | | | | | |")
        lines.append("")
    lines += ["## Targets (issue 18)", "", "| target | verdict | numbers |", "|---|---|---|"]
    targets = []
    for wl in wls:
        w = best.get(("wanxfer", wl))
        peers = [(best[(t, wl)]["gbit"], t) for t in PEERS if (t, wl) in best]
        if w and peers:
            pb, pt = max(peers)
            targets.append((f"{wl}: wanxfer >= 1.5x the best encrypted peer", w["gbit"] >= 1.5 * pb,
                            f"{w['gbit']:.2f} / {pb:.2f} ({pt}) = {w['gbit'] / pb:.2f}x"))
            per_gb = lambda r: (r["client_cpu_s"] + r["server_cpu_s"]) / (r["bytes"] / 1e9)  # noqa: E731
            cp, ct = min((per_gb(best[(t, wl)]), t) for _, t in peers)
            targets.append((f"{wl}: the same by CPU per GB (sender + receiver; lowest peer)", cp >= 1.5 * per_gb(w),
                            f"{ct} {cp:.3f} / wanxfer {per_gb(w):.3f} CPU s/GB = {cp / per_gb(w):.2f}x"))
    w, fl = best.get(("wanxfer", "mem")), best.get(("floor", "mem"))
    if w and fl:
        targets.append(("mem: wanxfer >= 0.9x the cipher floor", w["gbit"] >= 0.9 * fl["gbit"],
                        f"{w['gbit']:.2f} / {fl['gbit']:.2f} = {w['gbit'] / fl['gbit']:.2f}x by the harness's clock; "
                        f"{w['self_gbit']:.2f} / {fl['gbit']:.2f} = {w['self_gbit'] / fl['gbit']:.2f}x by "
                        "wanxfer's own (transfer only, as the floor's)"))
        # On a loaded machine Gbit/s follows each tool's share of the cores (wanxfer has
        # more threads than the floor's two); CPU per byte does not. On two idle cores
        # both sides run at once, so the rate follows CPU s/GB of both sides together.
        cw = (w["client_cpu_s"] + w["server_cpu_s"]) / (w["bytes"] / 1e9)
        cf = (fl["client_cpu_s"] + fl["server_cpu_s"]) / (fl["bytes"] / 1e9)
        targets.append(("mem: the same by CPU per GB (sender + receiver)", cf / cw >= 0.9,
                        f"floor {cf:.3f} / wanxfer {cw:.3f} CPU s/GB = {cf / cw:.2f}x"))
    for wl in wls:
        w, p = best.get(("wanxfer", wl)), best.get(("wanxfer-plain", wl))
        if w and p:
            targets.append((f"{wl}: encrypted / --no-encryption (no target)", None,
                            f"{w['gbit']:.2f} / {p['gbit']:.2f} = {w['gbit'] / p['gbit']:.2f}x"))
    doc["targets"] = [{"target": t, "pass": v, "numbers": d} for t, v, d in targets]
    lines += [f"| {t} | {'-' if v is None else ('PASS' if v else 'MISS')} | {d} |" for t, v, d in targets]
    lines += ["", "## Every run (in the order run)", "",
              "| workload | tool | knobs | Gbit/s | sender CPU s | receiver CPU s | load at start | note |",
              "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if "gbit" in r:
            lines.append(f"| {r['workload']} | {r['tool']} | `{r['knobs']}` | "
                         f"{r['gbit']:.2f}{'' if r['verified'] else ' FAILED'} | {r['client_cpu_s']:.2f} | "
                         f"{r['server_cpu_s']:.2f} | {r['load']} | {r['note'][:120].replace('|', '/')} |")
        else:
            err = r["error"].replace("|", "/").replace("\n", " ")[:200]
            lines.append(f"| {r['workload']} | {r['tool']} | `{r['knobs']}` | FAILED | | | {r['load']} | {err} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
