#!/usr/bin/env python
"""Rollout tokens/s with N rollout engines (--rollout-num-workers) against one, same prompts.

    python scripts/bench/rollout_engines.py [--workers 2] [--steps 6] [-- extra train_rl.py flags]

Rollout only (--debug-rollout-only: the same checkpoint weights every step, so both arms sample
the same tokens: every request has its own seeded generator, whichever engine runs it). Prints
rollout tokens/s per arm from step 1 on, the ratio, and the generated token counts of both arms
(equal: both did the same work). With a core per engine, two engines should come near twice one engine's tokens/s.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rl_arms import column, fmt, mean_se, run_arm  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default="runs/bench_engines")
    p.add_argument("extra", nargs="*", help="after --: passed to every train_rl.py run")
    args = p.parse_args()
    base = ["--num-rollout", args.steps, "--debug-rollout-only", *args.extra]
    results = {n: run_arm(f"engines_{n}", args.out, base + ["--rollout-num-workers", n]) for n in (1, args.workers)}
    print(f"cores: {os.cpu_count()}")
    print("| engines | rollout tokens/s (steps 1..) | x one engine | tokens generated |")
    print("|---|---|---|---|")
    one = mean_se(column(results[1], "perf/rollout_tokens_per_s", skip=1))[0]
    for n, rows in results.items():
        rate = mean_se(column(rows, "perf/rollout_tokens_per_s", skip=1))
        tokens = sum(r["rollout/response_len"] * r["rollout/num_samples"] for r in rows)
        print(f"| {n} | {fmt(*rate)} | {rate[0] / one:.2f} | {tokens:.0f} |")


if __name__ == "__main__":
    main()
