"""GEMM cost against the rows it multiplies: plain `x @ W.t()` vs rollout/embedded/linear.py's packed backend.

A verify forward of 1 + k tokens multiplies every weight by 1 + k rows per request; on a
memory-bound step that should cost about one row. One 8192x4096 fp32 weight (128 MB, larger
than the caches), M = 1/2/4/16 rows; prints milliseconds (median of repeats) and each
backend's cost relative to its own 1-row GEMV, plus packed/plain per M (ratios within one run).
"packed" is oneDNN's kernel itself (rollout/embedded/linear.py sends one row, and few rows of a weight
under PACKED_MIN_BYTES, to the plain matmul; a small weight shows why:
`--out 320 --in 128 --rows 1,2,16,128,512 --threads 1`, the tiny model's MLP).
Usage:
  python scripts/bench/gemm_rows.py [--threads 2] [--repeats 30] [--out 8192 --in 4096]
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from rollout.embedded.linear import linear, pack, pick_backend  # noqa: E402


def median_ms(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=int, default=8192)
    ap.add_argument("--in", dest="in_features", type=int, default=4096)
    ap.add_argument("--rows", default="1,2,4,16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weight = torch.randn(args.out, args.in_features)
    packed_backend = pick_backend("cpu", torch.float32)
    # the kernel itself at every row count (linear()'s own dispatch would hide the crossover)
    packed = dataclasses.replace(pack(weight, packed_backend), min_packed_rows=2)
    backends = {"plain": pack(weight, "dense"), "packed": packed}
    rows = [int(m) for m in args.rows.split(",")]
    print(f"weight {args.out}x{args.in_features} fp32 ({weight.numel() * 4 / 2**20:.2f} MiB), "
          f"{args.threads} threads, packed backend = {packed_backend}")
    ms = {name: {} for name in backends}
    for m in rows:
        x = torch.randn(m, args.in_features)
        # interleave the backends per M so a busy machine slows both alike
        for name, w in backends.items():
            ms[name][m] = median_ms(lambda: linear(x, w), args.repeats)
    print(f"{'rows':>4} {'plain ms':>9} {'packed ms':>10} {'plain/1row':>11} {'packed/1row':>12} {'packed/plain':>13}")
    for m in rows:
        p, q = ms["plain"][m], ms["packed"][m]
        print(f"{m:>4} {p:>9.2f} {q:>10.2f} {p / ms['plain'][rows[0]]:>11.2f} {q / ms['packed'][rows[0]]:>12.2f} "
              f"{q / p:>13.2f}")
    if 4 in rows and 1 in rows:
        print(f"packed 4 rows / plain 1 row: {ms['packed'][4] / ms['plain'][1]:.2f}x")


if __name__ == "__main__":
    main()
