#!/usr/bin/env python
"""--async-rollout (one step off-policy) against the synchronous loop on the same run.

    python scripts/bench/async_rollout.py [--steps 12] [--out runs/bench_async] [-- extra train_rl.py flags]

Three arms of the default run (the tiny model, MTP drafting with the online-trained draft):
sync; async (the PPO ratio against the rollout's log-probs); async + --use-tis. Per arm: mean
step time from step 1 on (step 0 of the async arms is synchronous and holds the start-up), the
ratio async / sync, reward (mean over all steps ± s.e.), the draft's acceptance length (async:
drafted by a draft one step old, beside the synchronous draft's), tokens generated per step
(both sides did the same amount of work when these match within noise), and the staleness logged.
The overlap shows as the async/sync step-time ratio; the reward curves should agree within noise.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rl_arms import column, fmt, mean_se, run_arm  # noqa: E402

ARMS = {"sync": [], "async": ["--async-rollout"], "async_tis": ["--async-rollout", "--use-tis"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default="runs/bench_async")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("extra", nargs="*", help="after --: passed to every train_rl.py run")
    args = p.parse_args()
    base = ["--num-rollout", args.steps, "--enable-mtp-training", "--mtp-num-layers", 1, *args.extra]
    results = {arm: run_arm(arm, args.out, base + ARMS[arm]) for arm in args.arms.split(",")}
    sync_time = mean_se(column(results["sync"], "perf/step_time", skip=1))[0] if "sync" in results else None
    print("| arm | step time s (steps 1..) | x sync | reward | accept length | tokens/step | weight / draft staleness |")
    print("|---|---|---|---|---|---|---|")
    for arm, rows in results.items():
        t = mean_se(column(rows, "perf/step_time", skip=1))
        tokens = mean_se(r["rollout/response_len"] * r["rollout/num_samples"] for r in rows)
        ratio = f"{t[0] / sync_time:.2f}" if sync_time else "-"
        stale = f"{mean_se(column(rows, 'rollout/weight_staleness', default=0))[0]:.2f} / " \
                f"{mean_se(column(rows, 'rollout/draft_staleness', default=0))[0]:.2f}"
        print(f"| {arm} | {fmt(*t)} | {ratio} | {fmt(*mean_se(column(rows, 'rollout/reward')))} | "
              f"{fmt(*mean_se(column(rows, 'rollout/spec_accept_length')))} | {fmt(*tokens)} | {stale} |")


if __name__ == "__main__":
    main()
