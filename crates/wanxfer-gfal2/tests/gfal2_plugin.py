"""Drives the wanxfer gfal2 plugin through gfal2's own Python bindings (python3-gfal2),
as FTS3 and Rucio drive gfal2, against a wanxfer server on loopback.

Run by tests/gfal2.rs, which starts the server, points GFAL_PLUGIN_DIR at a directory
holding the built plugin, plants the files and symlinks named below, and checks the
server's tree afterwards. Usage:

    gfal2_plugin.py BASE_URL SERVER_ROOT SCRATCH_DIR SECRET MODE [BASE_URL2 SERVER_ROOT2]

BASE_URL is wanxfer://HOST:PORT/, SERVER_ROOT the served directory (to compare bytes on
the server's side too), SCRATCH_DIR a local directory of the test's own, MODE `full`
(every check, the plugin alone in GFAL_PLUGIN_DIR) or `coexist` (a few checks, with
Debian's other plugins loaded beside it). BASE_URL2 and SERVER_ROOT2 name a second
server with the same secret, for third-party copies (`full` only). Prints one line per check and a closing
"N passed, N failed"; exits non-zero if any failed.
"""

import errno
import hashlib
import os
import stat
import sys
import zlib

import gfal2

BASE, ROOT, SCRATCH, SECRET, MODE = sys.argv[1:6]
BASE2, ROOT2 = (sys.argv[6:8] + [None, None])[:2]
results = []


def check(fn):
    try:
        fn()
        results.append((fn.__name__, None))
        print("ok", fn.__name__, flush=True)
    except Exception as e:  # noqa: BLE001 - every failure is reported, then counted
        results.append((fn.__name__, e))
        print("FAIL", fn.__name__, repr(e), flush=True)
    return fn


def context(secret=None):
    ctx = gfal2.creat_context()
    if secret is not None:
        ctx.set_opt_string("WANXFER", "SECRET", secret)
    return ctx


def expect_errno(code, fn, *args):
    try:
        fn(*args)
    except gfal2.GError as e:
        assert e.code == code, "expected errno %d, got %d: %s" % (code, e.code, e)
        return e
    raise AssertionError("expected errno %d, the call succeeded" % code)


def local(name, size=0, seed=0):
    path = os.path.join(SCRATCH, name)
    if size:
        data = hashlib.sha256(str(seed).encode()).digest() * (size // 32 + 1)
        with open(path, "wb") as f:
            f.write(data[:size])
    return path


def read(path):
    with open(path, "rb") as f:
        return f.read()


ctx = context()  # the secret comes from WANXFER_SECRET in the environment


def test_plugin_is_loaded():
    names = ctx.get_plugin_names()
    assert any(n.startswith("wanxfer-") for n in names), names


def test_stat_file_and_directory():
    st = ctx.stat(BASE + "data/hello.txt")
    assert stat.S_ISREG(st.st_mode) and st.st_size == len(read(os.path.join(ROOT, "data/hello.txt")))
    assert stat.S_IMODE(st.st_mode) == 0o640, oct(st.st_mode)
    assert stat.S_ISDIR(ctx.stat(BASE + "data").st_mode)
    assert stat.S_ISLNK(ctx.lstat(BASE + "data/link").st_mode)
    expect_errno(errno.ENOENT, ctx.stat, BASE + "data/missing")


def test_listdir_hides_temporaries():
    names = sorted(ctx.listdir(BASE + "data"))
    assert names == ["big.bin", "hello.txt", "link", "sub"], names
    assert ctx.listdir(BASE + "data/sub") == []
    expect_errno(errno.ENOTDIR, ctx.listdir, BASE + "data/hello.txt")
    expect_errno(errno.ENOENT, ctx.listdir, BASE + "nowhere")


def test_readdirpp_gives_metadata():
    d = ctx.opendir(BASE + "data")
    seen = {}
    while True:
        entry, st = d.readpp()
        if entry is None:
            break
        seen[entry.d_name] = st
    assert seen["big.bin"].st_size == os.path.getsize(os.path.join(ROOT, "data/big.bin"))
    assert stat.S_ISDIR(seen["sub"].st_mode)


def test_mkdir_and_mkdir_rec():
    ctx.mkdir(BASE + "made", 0o755)
    assert os.path.isdir(os.path.join(ROOT, "made"))
    expect_errno(errno.EEXIST, ctx.mkdir, BASE + "made", 0o755)
    ctx.mkdir_rec(BASE + "made/a/b/c", 0o755)
    ctx.mkdir_rec(BASE + "made/a/b/c", 0o755)  # an existing directory is fine
    assert os.path.isdir(os.path.join(ROOT, "made/a/b/c"))
    expect_errno(errno.ENOENT, ctx.mkdir, BASE + "absent/child", 0o755)


def test_checksums_match_python():
    data = read(os.path.join(ROOT, "data/big.bin"))
    adler = ctx.checksum(BASE + "data/big.bin", "adler32")
    assert adler == "%08x" % zlib.adler32(data), adler
    assert ctx.checksum(BASE + "data/big.bin", "ADLER32") == adler
    assert ctx.checksum(BASE + "data/big.bin", "MD5") == hashlib.md5(data).hexdigest()
    assert len(ctx.checksum(BASE + "data/big.bin", "xxh3")) == 32
    expect_errno(errno.ENOSYS, ctx.checksum, BASE + "data/big.bin", "sha1")
    expect_errno(errno.ENOSYS, ctx.checksum, BASE + "data/big.bin", "adler32", 10, 100)
    expect_errno(errno.EISDIR, ctx.checksum, BASE + "data/sub", "adler32")


def test_filecopy_push_and_pull_byte_for_byte():
    src = local("push.bin", 5_000_003, seed=1)
    expect_errno(errno.ENOENT, ctx.filecopy, ctx.transfer_parameters(), "file://" + src, BASE + "copies/pushed.bin")
    ctx.mkdir(BASE + "copies", 0o755)
    params = ctx.transfer_parameters()
    progress = []
    events = []
    params.monitor_callback = lambda s, d, avg, inst, done, elapsed: progress.append(done)
    params.event_callback = lambda e: events.append(str(e.stage))
    ctx.filecopy(params, "file://" + src, BASE + "copies/pushed.bin")
    assert read(os.path.join(ROOT, "copies/pushed.bin")) == read(src)
    assert progress and progress[-1] == 5_000_003, progress
    assert "TRANSFER:ENTER" in events and "TRANSFER:EXIT" in events, events
    back = local("pulled.bin")
    ctx.filecopy(ctx.transfer_parameters(), BASE + "copies/pushed.bin", "file://" + back)
    assert read(back) == read(src)


def test_filecopy_respects_overwrite_and_parents():
    src = local("over.bin", 70_000, seed=2)
    params = ctx.transfer_parameters()
    params.create_parent = True
    ctx.filecopy(params, "file://" + src, BASE + "deep/new/parent/over.bin")
    e = expect_errno(errno.EEXIST, ctx.filecopy, params, "file://" + src, BASE + "deep/new/parent/over.bin")
    assert "DESTINATION" in str(e), e
    newer = local("newer.bin", 1234, seed=3)
    params.overwrite = True
    ctx.filecopy(params, "file://" + newer, BASE + "deep/new/parent/over.bin")
    assert read(os.path.join(ROOT, "deep/new/parent/over.bin")) == read(newer)
    existing = local("exists-locally.bin", 10, seed=4)
    plain = ctx.transfer_parameters()
    expect_errno(errno.EEXIST, ctx.filecopy, plain, BASE + "data/hello.txt", "file://" + existing)
    expect_errno(errno.EISDIR, ctx.filecopy, plain, BASE + "data/sub", "file://" + local("dir-copy"))
    expect_errno(errno.ENOENT, ctx.filecopy, plain, BASE + "data/missing", "file://" + local("m"))


def test_filecopy_checksums():
    src = local("summed.bin", 300_000, seed=5)
    params = ctx.transfer_parameters()
    params.set_checksum(gfal2.checksum_mode.both, "ADLER32", "")
    ctx.filecopy(params, "file://" + src, BASE + "copies/summed.bin")
    wrong = ctx.transfer_parameters()
    wrong.overwrite = True
    wrong.set_checksum(gfal2.checksum_mode.both, "ADLER32", "00000001")
    e = expect_errno(errno.EIO, ctx.filecopy, wrong, "file://" + src, BASE + "copies/summed.bin")
    assert "CHECKSUM" in str(e), e
    user = ctx.transfer_parameters()
    user.overwrite = True
    user.set_checksum(gfal2.checksum_mode.source, "adler32", "%x" % zlib.adler32(read(src)))
    ctx.filecopy(user, "file://" + src, BASE + "copies/summed.bin")


def test_rename_unlink_rmdir():
    ctx.filecopy(ctx.transfer_parameters(), "file://" + local("r.bin", 100, seed=6), BASE + "made/r.bin")
    ctx.rename(BASE + "made/r.bin", BASE + "made/a/renamed.bin")
    assert os.path.isfile(os.path.join(ROOT, "made/a/renamed.bin"))
    expect_errno(errno.EISDIR, ctx.unlink, BASE + "made/a")
    expect_errno(errno.ENOTEMPTY, ctx.rmdir, BASE + "made/a")
    ctx.unlink(BASE + "made/a/renamed.bin")
    expect_errno(errno.ENOENT, ctx.unlink, BASE + "made/a/renamed.bin")
    ctx.rmdir(BASE + "made/a/b/c")
    assert not os.path.exists(os.path.join(ROOT, "made/a/b/c"))


def test_symlinks_in_the_tree_are_never_followed():
    expect_errno(errno.EACCES, ctx.stat, BASE + "escape/precious")
    expect_errno(errno.EACCES, ctx.listdir, BASE + "escape/sub")
    expect_errno(errno.EACCES, ctx.checksum, BASE + "escape/precious", "adler32")
    expect_errno(errno.EACCES, ctx.unlink, BASE + "escape/precious")
    expect_errno(errno.EACCES, ctx.mkdir_rec, BASE + "escape/planted/deeper", 0o755)
    expect_errno(errno.EACCES, ctx.filecopy, ctx.transfer_parameters(), "file://" + local("p.bin", 10, seed=7), BASE + "escape/planted.bin")
    expect_errno(errno.EACCES, ctx.stat, BASE + "data/.wanxfer-0011-2233.part")


def test_third_party_copy_between_two_servers():
    original = read(os.path.join(ROOT, "data/big.bin"))
    params = ctx.transfer_parameters()
    params.create_parent = True
    params.set_checksum(gfal2.checksum_mode.both, "ADLER32", "")
    progress = []
    events = []
    params.monitor_callback = lambda s, d, avg, inst, done, elapsed: progress.append(done)
    params.event_callback = lambda e: events.append((str(e.stage), str(e.description)))
    ctx.filecopy(params, BASE + "data/big.bin", BASE2 + "tpc/big.bin")
    assert read(os.path.join(ROOT2, "tpc/big.bin")) == original
    assert progress and progress[-1] == len(original), progress
    stages = [stage for stage, _ in events]
    assert "TRANSFER:ENTER" in stages and "TRANSFER:EXIT" in stages, events
    assert ("TRANSFER:TYPE", "3rd push") in events, events
    sums = [text for stage, text in events if stage == "CHECKSUM:EXIT"]
    assert sums == ["%08x" % zlib.adler32(original)] * 2, events
    # gfal2's rules for the destination, checked on the destination server.
    e = expect_errno(errno.EEXIST, ctx.filecopy, ctx.transfer_parameters(), BASE + "data/big.bin", BASE2 + "tpc/big.bin")
    assert "DESTINATION" in str(e), e
    expect_errno(errno.ENOENT, ctx.filecopy, ctx.transfer_parameters(), BASE + "data/missing", BASE2 + "tpc/m")
    expect_errno(errno.ENOENT, ctx.filecopy, ctx.transfer_parameters(), BASE + "data/hello.txt", BASE2 + "no/parent.txt")
    # Back the other way, the second server as the source, replacing a file.
    over = ctx.transfer_parameters()
    over.overwrite = True
    ctx.filecopy(over, BASE2 + "tpc/big.bin", BASE + "data/hello.txt")
    assert read(os.path.join(ROOT, "data/hello.txt")) == original
    # A wrong secret for the servers: refused as gfal2 callers expect.
    expect_errno(errno.EACCES, context("not-the-secret").filecopy, ctx.transfer_parameters(), BASE + "data/big.bin", BASE2 + "tpc/x.bin")


def test_credentials_from_configuration():
    expect_errno(errno.EACCES, context("not-the-secret").stat, BASE + "data")
    secret_file = local("secret")
    with open(secret_file, "w") as f:
        f.write(SECRET + "\n")
    os.chmod(secret_file, 0o600)
    by_file = gfal2.creat_context()
    by_file.set_opt_string("WANXFER", "SECRET_FILE", secret_file)
    assert stat.S_ISDIR(by_file.stat(BASE + "data").st_mode)


def test_coexists_with_the_other_plugins():
    names = ctx.get_plugin_names()
    assert any(n.startswith("file-") for n in names), names
    src = local("coexist.bin", 100_000, seed=8)
    ctx.filecopy(ctx.transfer_parameters(), "file://" + src, BASE + "coexist.bin")
    assert ctx.checksum(BASE + "coexist.bin", "adler32") == ctx.checksum("file://" + src, "adler32")


if MODE == "full":
    tests = [
        test_plugin_is_loaded, test_stat_file_and_directory, test_listdir_hides_temporaries,
        test_readdirpp_gives_metadata, test_mkdir_and_mkdir_rec, test_checksums_match_python,
        test_filecopy_push_and_pull_byte_for_byte, test_filecopy_respects_overwrite_and_parents,
        test_filecopy_checksums, test_rename_unlink_rmdir,
        test_symlinks_in_the_tree_are_never_followed, test_third_party_copy_between_two_servers,
        test_credentials_from_configuration,
    ]
else:
    tests = [test_plugin_is_loaded, test_coexists_with_the_other_plugins]
for t in tests:
    check(t)
failed = sum(1 for _, e in results if e is not None)
print("%d passed, %d failed" % (len(results) - failed, failed))
sys.exit(1 if failed else 0)
