#!/usr/bin/env python
"""bf16 vs fp32: the same online-MTP RL run with and without --bf16, over seeds.

    python scripts/bench/bf16_vs_fp32.py                        # embedded engine, 2 seeds, 40 steps
    python scripts/bench/bf16_vs_fp32.py --backend vllm --out runs/bf16_vs_fp32_vllm

Each arm is train_rl.py on the shipped tiny model with `--enable-mtp-training --mtp-num-layers 1`
(MTP k = 2), one per dtype and seed (--seed and --rollout-seed set together). The two dtypes sample
different tokens from the first step on, so their RL trajectories part as two seeds of one dtype
do: the question is whether the bf16 runs' acceptance lies within the seed-to-seed spread of the
fp32 runs', not whether it equals it. Printed per arm: acceptance length (1 + accepted drafts per
verify, vLLM's definition) and reward over the first and last --window steps, the trainer-vs-rollout
log-prob difference (train/logprob_abs_diff), and the trainer's and rollout's seconds per step.
Then per dtype the mean over seeds of the end acceptance with its standard error, the bf16 - fp32
difference and whether it is within 3 standard errors (the noise). On a CPU without native bf16
(AVX2: no AVX512_BF16 / AMX) bf16 matmuls are emulated, so the bf16 arms are slower there;
the timing columns say by how much, they are not a claim about bf16 on hardware that has it.
Extra arguments after `--` go to every run.
"""
import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rl_arms import REPO, column, mean_se, run_arm  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="RL steps per run")
    p.add_argument("--seeds", default="1234:42,1:1", help="comma-separated TRAINER_SEED:ROLLOUT_SEED pairs")
    p.add_argument("--backend", default="embedded", help="--rollout-backend of every run")
    p.add_argument("--window", type=int, default=5, help="steps averaged for the start and end figures")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bf16_vs_fp32"))
    p.add_argument("--reuse", action="store_true",
                   help="a run whose --out directory already holds all --steps steps is read, not rerun")
    p.add_argument("extra", nargs="*", help="after --: passed to train_rl.py")
    return p.parse_args()


def arm_rows(args, dtype, seed, rollout_seed):
    name = f"{dtype}_seed{seed}_{rollout_seed}"
    done = os.path.join(args.out, name, "metrics.jsonl")
    if args.reuse and os.path.isfile(done):
        rows = [json.loads(line) for line in open(done)]
        if len(rows) >= args.steps:  # a longer run's first steps are this run (same seed, same flags)
            print(f"[bench] {name}: reusing the first {args.steps} steps of {done}", flush=True)
            return rows[:args.steps]
    flags = ["--enable-mtp-training", "--mtp-num-layers", 1, "--num-rollout", args.steps, "--rollout-backend",
             args.backend, "--seed", seed, "--rollout-seed", rollout_seed, *(["--bf16"] if dtype == "bf16" else []),
             *args.extra]
    return run_arm(name, args.out, flags)


def window(rows, key, first, size):
    values = column(rows[:size] if first else rows[-size:], key)
    return statistics.fmean(v for v in values if v is not None)


def main():
    args = parse_args()
    seeds = [tuple(pair.split(":")) for pair in args.seeds.split(",")]
    runs = {(dtype, s): arm_rows(args, dtype, *s) for s in seeds for dtype in ("fp32", "bf16")}
    w = args.window
    print(f"\n{'run':<22} {'accept_len start':>16} {'end':>7} {'reward start':>13} {'end':>7} "
          f"{'logprob diff':>13} {'train s/step':>13} {'rollout s/step':>15}")
    for (dtype, (seed, rseed)), rows in runs.items():
        diff, _ = mean_se(column(rows, "train/logprob_abs_diff"))
        train_s, _ = mean_se(column(rows, "perf/train_time", skip=1))
        roll_s, _ = mean_se(column(rows, "perf/rollout_time", skip=1))
        print(f"{dtype + ' seed ' + seed + '/' + rseed:<22} {window(rows, 'rollout/spec_accept_length', True, w):>16.3f} "
              f"{window(rows, 'rollout/spec_accept_length', False, w):>7.3f} {window(rows, 'rollout/reward', True, w):>13.3f} "
              f"{window(rows, 'rollout/reward', False, w):>7.3f} {diff:>13.2e} {train_s:>13.2f} {roll_s:>15.2f}")
    end = {dtype: [window(runs[(dtype, s)], "rollout/spec_accept_length", False, w) for s in seeds]
           for dtype in ("fp32", "bf16")}
    stats = {dtype: mean_se(values) for dtype, values in end.items()}
    for dtype, (m, se) in stats.items():
        print(f"{dtype}: end acceptance length over {len(seeds)} seeds {m:.3f} ± {se:.3f} (standard error)")
    (mf, sf), (mb, sb) = stats["fp32"], stats["bf16"]
    if len(seeds) > 1:
        noise = math.hypot(sf, sb)
        print(f"bf16 - fp32 (end, over seeds): {mb - mf:+.3f}; 3 standard errors of the difference: {3 * noise:.3f}; "
              f"within noise: {abs(mb - mf) <= 3 * noise}")
    # paired by step: each step of a seed's two runs starts from the same prompts, so the per-step
    # differences and their spread say whether bf16 drafts differently from fp32 over the whole run
    diffs = [b - f for s in seeds for f, b in zip(column(runs[("fp32", s)], "rollout/spec_accept_length"),
                                                  column(runs[("bf16", s)], "rollout/spec_accept_length"))]
    d, se = mean_se(diffs)
    print(f"bf16 - fp32 acceptance length, paired by step over {len(diffs)} steps: {d:+.4f} ± {se:.4f} "
          f"(standard error); within 3 standard errors of 0: {abs(d) <= 3 * se}")
    speed = {dtype: statistics.fmean(mean_se(column(runs[(dtype, s)], "perf/train_time", skip=1))[0] for s in seeds)
             for dtype in ("fp32", "bf16")}
    print(f"trainer seconds per step bf16 / fp32: {speed['bf16'] / speed['fp32']:.2f}x")


if __name__ == "__main__":
    main()
