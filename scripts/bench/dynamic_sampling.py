#!/usr/bin/env python
"""--dynamic-sampling (DAPO) against plain sampling on the same run, over one or more seeds.

    python scripts/bench/dynamic_sampling.py [--steps 12] [--seeds 42] [--out runs/bench_dynamic]
                                             [-- extra train_rl.py flags]

Per arm and seed (--rollout-seed: prompt order and sampling, the same for both arms of a seed):
share of zero-signal groups (all rewards equal, so no GRPO gradient) in the batches the trainer
trained on, reward per step (the policy's: over every sample drawn), draws per step and the kept
fraction, and rollout seconds per step (the price: more prompts drawn). With several seeds it
also prints the paired reward difference (dynamic - plain) per seed and its mean ± SE over seeds:
one run's per-step rewards are correlated, seeds are independent.
Dynamic sampling should leave no zero-signal group in a trained batch at no loss of reward per step.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rl_arms import column, fmt, mean_se, run_arm  # noqa: E402

ARMS = {"plain": [], "dynamic": ["--dynamic-sampling"]}


def arm_row(arm, seed, rows):
    half = len(rows) // 2
    return (f"| {arm} | {seed} | {fmt(*mean_se(column(rows, 'rollout/zero_signal_share')))} | "
            f"{fmt(*mean_se(column(rows, 'rollout/reward')))} | {fmt(*mean_se(column(rows, 'rollout/reward', skip=half)))} | "
            f"{fmt(*mean_se(column(rows, 'rollout/dynamic_sampling_draws', default=1)))} | "
            f"{fmt(*mean_se(column(rows, 'rollout/dynamic_sampling_kept_fraction', default=1.0)))} | "
            f"{fmt(*mean_se(column(rows, 'perf/rollout_time', skip=1)))} |")


def mean_reward(rows):
    return mean_se(column(rows, "rollout/reward"))[0]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seeds", default="42", help="--rollout-seed values, comma-separated")
    p.add_argument("--out", default="runs/bench_dynamic")
    p.add_argument("extra", nargs="*", help="after --: passed to every train_rl.py run")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    base = ["--num-rollout", args.steps, "--enable-mtp-training", "--mtp-num-layers", 1, *args.extra]
    results = {seed: {arm: run_arm(f"seed{seed}_{arm}", args.out, base + ["--rollout-seed", seed] + flags)
                      for arm, flags in ARMS.items()} for seed in seeds}
    print("| arm | seed | zero-signal share trained | reward | reward last half | draws/step | kept fraction "
          "| rollout s/step |")
    print("|---|---|---|---|---|---|---|---|")
    for seed, arms in results.items():
        for arm, rows in arms.items():
            print(arm_row(arm, seed, rows))
    diffs = [mean_reward(arms["dynamic"]) - mean_reward(arms["plain"]) for arms in results.values()]
    print("reward, dynamic - plain, per seed: " + ", ".join(f"{d:+.3f}" for d in diffs))
    if len(diffs) > 1:
        print(f"over {len(diffs)} seeds: {fmt(*mean_se(diffs))}")


if __name__ == "__main__":
    main()
