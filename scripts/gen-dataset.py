#!/usr/bin/env python3
"""Writes a reproducible dataset: large files and/or many small files, fixed seed.

usage: gen-dataset.py DIR [--large-mib N] [--small-count N] [--small-kib N]
       [--dirs N] [--lognormal-gib G] [--seed S]
"""
import argparse
import os
import random


def fill(path, size, rng):
    with open(path, "wb") as f:
        left = size
        chunk = 1 << 20
        while left > 0:
            n = min(chunk, left)
            f.write(rng.randbytes(n))
            left -= n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--large-mib", type=int, default=0, help="one large file of this size")
    ap.add_argument("--small-count", type=int, default=0)
    ap.add_argument("--small-kib", type=int, default=64, help="size of each small file")
    ap.add_argument("--dirs", type=int, default=100, help="spread small files over this many directories")
    ap.add_argument("--lognormal-gib", type=float, default=0, help="a tree of log-normally sized files")
    ap.add_argument("--seed", type=int, default=42)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    os.makedirs(a.dir, exist_ok=True)
    if a.large_mib:
        fill(os.path.join(a.dir, "large.bin"), a.large_mib << 20, rng)
    if a.small_count:
        # One random block reused with a per-file prefix: fast to write, distinct contents.
        base = rng.randbytes(a.small_kib << 10)
        for i in range(a.small_count):
            d = os.path.join(a.dir, "small", f"d{i % a.dirs:03d}")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"f{i:06d}"), "wb") as f:
                prefix = i.to_bytes(8, "little")
                f.write(prefix + base[8:])
    if a.lognormal_gib:
        budget = int(a.lognormal_gib * (1 << 30))
        i = 0
        while budget > 0:
            size = min(budget, int(rng.lognormvariate(11, 2.5)))
            d = os.path.join(a.dir, "mixed", f"d{i % 50:02d}", f"e{(i // 50) % 20:02d}")
            os.makedirs(d, exist_ok=True)
            fill(os.path.join(d, f"m{i:06d}"), size, rng)
            budget -= size
            i += 1


if __name__ == "__main__":
    main()
