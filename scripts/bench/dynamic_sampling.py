#!/usr/bin/env python
"""--dynamic-sampling (DAPO) against plain sampling on the same run.

    python scripts/bench/dynamic_sampling.py [--steps 12] [--out runs/bench_dynamic] [-- extra train_rl.py flags]

Per arm: share of zero-signal groups (all rewards equal, so no GRPO gradient) in the batches the
trainer trained on, reward per step (the policy's: over every sample drawn), draws per step and
the kept fraction, and rollout seconds per step (the price: more prompts drawn).
Dynamic sampling should leave no zero-signal group in a trained batch at no loss of reward per step.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rl_arms import column, fmt, mean_se, run_arm  # noqa: E402

ARMS = {"plain": [], "dynamic": ["--dynamic-sampling"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default="runs/bench_dynamic")
    p.add_argument("extra", nargs="*", help="after --: passed to every train_rl.py run")
    args = p.parse_args()
    base = ["--num-rollout", args.steps, "--enable-mtp-training", "--mtp-num-layers", 1, *args.extra]
    results = {arm: run_arm(arm, args.out, base + flags) for arm, flags in ARMS.items()}
    print("| arm | zero-signal share trained | reward | reward last half | draws/step | kept fraction | rollout s/step |")
    print("|---|---|---|---|---|---|---|")
    for arm, rows in results.items():
        half = len(rows) // 2
        print(f"| {arm} | {fmt(*mean_se(column(rows, 'rollout/zero_signal_share')))} | "
              f"{fmt(*mean_se(column(rows, 'rollout/reward')))} | {fmt(*mean_se(column(rows, 'rollout/reward', skip=half)))} | "
              f"{fmt(*mean_se(column(rows, 'rollout/dynamic_sampling_draws', default=1)))} | "
              f"{fmt(*mean_se(column(rows, 'rollout/dynamic_sampling_kept_fraction', default=1.0)))} | "
              f"{fmt(*mean_se(column(rows, 'perf/rollout_time', skip=1)))} |")


if __name__ == "__main__":
    main()
