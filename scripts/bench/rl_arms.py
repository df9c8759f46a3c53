#!/usr/bin/env python
"""The RL-arms benchmarks: train_rl.py runs side by side, one per arm, and a table of their metrics.

    python scripts/bench/rl_arms.py drift [--draft mtp|eagle3|dflash] [--arms online,frozen,none] [--steps 40]
    python scripts/bench/rl_arms.py async [--steps 12]          # --async-rollout against synchronous
    python scripts/bench/rl_arms.py dynamic [--seeds 42,2,3]    # --dynamic-sampling against plain
    python scripts/bench/rl_arms.py dtype [--seeds 1234:42,1:1] # --bf16 against fp32
    python scripts/bench/rl_arms.py engines [--workers 2]       # N rollout engines against one
    python scripts/bench/rl_arms.py routing [--backends embedded,vllm]  # MoE: routing replay against none

Every experiment takes --steps, --out, --reuse (an arm whose directory already holds --steps steps
is read, not rerun), and train_rl.py flags after `--` for every arm. `EXPERIMENT --help` says what
each prints. Arms run one after the other on the same machine; compare them within one run.
"""
import argparse
import dataclasses
import inspect
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from scripts.bench.lib import drift  # noqa: E402
from scripts.bench.lib.arm_runs import REPO, column, fmt, mean_se, run_arm, window  # noqa: E402
from vime.errors import UserError, exit_on_user_error  # noqa: E402

DEFAULT_RUN = ["--enable-mtp-training", "--mtp-num-layers", 1]  # the README's run: MTP k = 2, trained online


def run_async(args):
    """Sync against --async-rollout (one step off-policy), and with --use-tis: step time from step 1
    (step 0 of an async run is synchronous and holds the start-up), reward, acceptance length
    (async: drafted by a draft one step old), tokens per step (the same work when these match
    within noise) and the staleness logged."""
    arms = {"sync": [], "async": ["--async-rollout"], "async_tis": ["--async-rollout", "--use-tis"]}
    base = ["--num-rollout", args.steps, *DEFAULT_RUN]
    results = {arm: run_arm(arm, args.out, base + arms[arm] + args.extra, args.steps, args.reuse) for arm in arms}
    sync_time = mean_se(column(results["sync"], "perf/step_time", skip=1))[0]
    print("| arm | step time s (steps 1..) | x sync | reward | accept length | tokens/step | weight / draft staleness |")
    print("|---|---|---|---|---|---|---|")
    for arm, rows in results.items():
        t = mean_se(column(rows, "perf/step_time", skip=1))
        tokens = mean_se(r["rollout/response_len"] * r["rollout/num_samples"] for r in rows)
        stale = " / ".join(f"{mean_se(column(rows, f'rollout/{k}_staleness', default=0))[0]:.2f}" for k in ("weight", "draft"))
        print(f"| {arm} | {fmt(*t)} | {t[0] / sync_time:.2f} | {fmt(*mean_se(column(rows, 'rollout/reward')))} | "
              f"{fmt(*mean_se(column(rows, 'rollout/spec_accept_length')))} | {fmt(*tokens)} | {stale} |")


def run_dynamic(args):
    """Plain against --dynamic-sampling (DAPO) per seed (--rollout-seed, the same for both arms of a
    seed): zero-signal share of the trained batches, reward per step (over every sample drawn),
    draws per step, kept fraction, rollout seconds per step; then the paired reward difference per
    seed and its mean ± SE over seeds (one run's steps are correlated, seeds are independent)."""
    arms = {"plain": [], "dynamic": ["--dynamic-sampling"]}
    base = ["--num-rollout", args.steps, *DEFAULT_RUN]
    results = {seed: {arm: run_arm(f"seed{seed}_{arm}", args.out, base + ["--rollout-seed", seed] + flags + args.extra,
                                   args.steps, args.reuse)
                      for arm, flags in arms.items()} for seed in int_list(args.seeds, "--seeds")}
    print("| arm | seed | zero-signal share trained | reward | reward last half | draws/step | kept fraction "
          "| rollout s/step |")
    print("|---|---|---|---|---|---|---|---|")
    for seed, by_arm in results.items():
        for arm, rows in by_arm.items():
            cells = [column(rows, "rollout/zero_signal_share"), column(rows, "rollout/reward"),
                     column(rows, "rollout/reward", skip=len(rows) // 2),
                     column(rows, "rollout/dynamic_sampling_draws", default=1),
                     column(rows, "rollout/dynamic_sampling_kept_fraction", default=1.0),
                     column(rows, "perf/rollout_time", skip=1)]
            print(f"| {arm} | {seed} | " + " | ".join(fmt(*mean_se(c)) for c in cells) + " |")
    diffs = [mean_se(column(a["dynamic"], "rollout/reward"))[0] - mean_se(column(a["plain"], "rollout/reward"))[0]
             for a in results.values()]
    print("reward, dynamic - plain, per seed: " + ", ".join(f"{d:+.3f}" for d in diffs))
    if len(diffs) > 1:
        print(f"over {len(diffs)} seeds: {fmt(*mean_se(diffs))}")


def run_dtype(args):
    """fp32 against --bf16, one run per dtype and seed pair (--seed:--rollout-seed): acceptance length
    and reward over the first and last --window steps, the trainer-vs-rollout log-prob difference,
    trainer and rollout seconds per step; the bf16 - fp32 acceptance difference paired by step and,
    over several seeds, against the seed-to-seed spread. On a CPU without native bf16 (AVX2) bf16
    matmuls are emulated: the timings say by how much there, not what bf16 hardware does."""
    seeds = [tuple(pair.split(":")) for pair in args.seeds.split(",")]
    if any(len(s) != 2 for s in seeds):
        raise UserError(f"--seeds {args.seeds!r}: write TRAINER_SEED:ROLLOUT_SEED pairs, comma-separated")
    dtypes = {"fp32": [], "bf16": ["--bf16"]}
    runs = {(dtype, s): run_arm(f"{dtype}_seed{s[0]}_{s[1]}", args.out,
                                ["--num-rollout", args.steps, *DEFAULT_RUN, "--seed", s[0], "--rollout-seed", s[1],
                                 *flags, *args.extra], args.steps, args.reuse)
            for s in seeds for dtype, flags in dtypes.items()}
    w = args.window
    print(f"\n{'run':<22} {'accept_len start':>16} {'end':>7} {'reward start':>13} {'end':>7} "
          f"{'logprob diff':>13} {'train s/step':>13} {'rollout s/step':>15}")
    for (dtype, (seed, rseed)), rows in runs.items():
        print(f"{dtype + ' seed ' + seed + '/' + rseed:<22} {window(rows, 'rollout/spec_accept_length', True, w):>16.3f} "
              f"{window(rows, 'rollout/spec_accept_length', False, w):>7.3f} {window(rows, 'rollout/reward', True, w):>13.3f} "
              f"{window(rows, 'rollout/reward', False, w):>7.3f} {mean_se(column(rows, 'train/logprob_abs_diff'))[0]:>13.2e} "
              f"{mean_se(column(rows, 'perf/train_time', skip=1))[0]:>13.2f} "
              f"{mean_se(column(rows, 'perf/rollout_time', skip=1))[0]:>15.2f}")
    end = {dtype: mean_se(window(runs[(dtype, s)], "rollout/spec_accept_length", False, w) for s in seeds)
           for dtype in dtypes}
    if len(seeds) > 1:
        (mf, sf), (mb, sb) = end["fp32"], end["bf16"]
        print(f"bf16 - fp32 end acceptance over seeds: {mb - mf:+.3f}; within 3 SE ({3 * math.hypot(sf, sb):.3f}): "
              f"{abs(mb - mf) <= 3 * math.hypot(sf, sb)}")
    # paired by step: each step of a seed's two runs starts from the same prompts
    diffs = [b - f for s in seeds for f, b in zip(column(runs[("fp32", s)], "rollout/spec_accept_length"),
                                                  column(runs[("bf16", s)], "rollout/spec_accept_length"))]
    d, se = mean_se(diffs)
    print(f"bf16 - fp32 acceptance length, paired by step over {len(diffs)} steps: {d:+.4f} ± {se:.4f} (SE)")
    speed = {dtype: statistics.fmean(mean_se(column(runs[(dtype, s)], "perf/train_time", skip=1))[0] for s in seeds)
             for dtype in dtypes}
    print(f"trainer seconds per step bf16 / fp32: {speed['bf16'] / speed['fp32']:.2f}x")


def run_engines(args):
    """Rollout tokens/s of --workers rollout engines against one, rollout only (--debug-rollout-only:
    the same weights every step, so both arms sample the same tokens), at each batch size (prompts
    per step, each sampled --samples times; one engine may batch them all). Prints tokens/s from
    step 1 on, the ratio, and both arms' token counts; no ratio where the counts differ."""
    lines = []
    for prompts in int_list(args.batch_sizes, "--batch-sizes"):
        rows = prompts * args.samples
        base = ["--num-rollout", args.steps, "--debug-rollout-only", "--rollout-batch-size", prompts,
                "--n-samples-per-prompt", args.samples, "--rollout-max-batch-size", rows,
                "--global-batch-size", rows, "--micro-batch-size", rows]  # nothing is trained: any size fits
        out = os.path.join(args.out, f"b{prompts}")
        results = {n: run_arm(f"engines_{n}", out, base + ["--rollout-num-workers", n] + args.extra, args.steps, args.reuse)
                   for n in (1, args.workers)}
        counts = {n: round(sum(r["rollout/response_len"] * r["rollout/num_samples"] for r in rs)) for n, rs in results.items()}
        one = mean_se(column(results[1], "perf/rollout_tokens_per_s", skip=1))[0]
        for n, rs in results.items():
            rate = mean_se(column(rs, "perf/rollout_tokens_per_s", skip=1))
            ratio = f"{rate[0] / one:.2f}" if len(set(counts.values())) == 1 else "— (token counts differ)"
            lines.append(f"| {prompts} x {args.samples} | {n} | {fmt(*rate)} | {ratio} | {counts[n]} |")
    print(f"cores: {os.cpu_count()}")
    print("| prompts x samples | engines | rollout tokens/s (steps 1..) | x one engine | tokens generated |")
    print("|---|---|---|---|---|")
    print("\n".join(lines))


def run_routing(args):
    """MoE routing replay (--use-rollout-routing-replay) against none, in fp32 and under --bf16, on each
    --backends rollout backend (the MoE checkpoint: --hf-checkpoint after --, default the shipped tiny
    GLM-4.5): route disagreement (the share of routes the trainer's own routers choose differently),
    train/logprob_abs_diff, both paired by step (replay - none: each step of the two arms starts from the
    same prompts and seeds), route bytes per sample, and trainer seconds per step (from step 1) with the
    replay / none ratio. The arms run one after the other: a step-time ratio here is only indicative."""
    base = ["--num-rollout", args.steps, *DEFAULT_RUN, "--hf-checkpoint", args.hf_checkpoint]
    keys = ("train/route_disagreement", "train/logprob_abs_diff")
    print("| backend | dtype | arm | route disagreement | logprob_abs_diff | route bytes/sample | train s/step |")
    print("|---|---|---|---|---|---|---|")
    paired = []
    for backend in args.backends.split(","):
        for dtype, dtype_flags in (("fp32", []), ("bf16", ["--bf16"])):
            runs = {arm: run_arm(f"{backend}_{dtype}_{arm}", args.out, base + ["--rollout-backend", backend, *dtype_flags,
                                                                            *flags, *args.extra], args.steps, args.reuse)
                    for arm, flags in (("none", []), ("replay", ["--use-rollout-routing-replay"]))}
            for arm, rows in runs.items():
                cells = [fmt(*mean_se(column(rows, k))) for k in keys]
                cells += [fmt(*mean_se(column(rows, "rollout/route_bytes_per_sample"))),
                          fmt(*mean_se(column(rows, "perf/train_time", skip=1)))]
                print(f"| {backend} | {dtype} | {arm} | " + " | ".join(cells) + " |")
            diffs = [fmt(*mean_se(b - a for a, b in zip(column(runs["none"], k), column(runs["replay"], k))))
                     for k in keys]
            times = [mean_se(column(runs[arm], "perf/train_time", skip=1))[0] for arm in ("none", "replay")]
            paired.append(f"| {backend} | {dtype} | {diffs[0]} | {diffs[1]} | {times[1] / times[0]:.3f} |")
    print("\n| backend | dtype | route disagreement, replay - none | logprob_abs_diff, replay - none "
          "| train s/step replay / none |")
    print("|---|---|---|---|---|")
    print("\n".join(paired))


def add_routing_arguments(p):
    p.add_argument("--backends", default="embedded,vllm", help="rollout backends, comma-separated")
    p.add_argument("--hf-checkpoint", default=os.path.join(REPO, "checkpoints", "tiny-glm4-moe-mtp"),
                   help="an MoE checkpoint")


def int_list(text, flag):
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"{flag} {text!r}: give comma-separated integers")


def add_dtype_arguments(p):
    p.add_argument("--seeds", default="1234:42,1:1", help="comma-separated TRAINER_SEED:ROLLOUT_SEED pairs")
    p.add_argument("--window", type=int, default=5, help="steps averaged for the start and end figures")


def add_engines_arguments(p):
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-sizes", default="16,64,128", help="prompts per step, comma-separated")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (a GRPO group)")


def add_seeds_argument(p):
    p.add_argument("--seeds", default="42", help="--rollout-seed values, comma-separated")


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One RL-arms benchmark: its runner, its default --steps, its own flags and its --help text."""

    run: callable
    default_steps: int
    add_arguments: callable
    description: str


EXPERIMENTS = {
    "drift": Experiment(drift.run, 40, drift.add_arguments, drift.__doc__),
    "async": Experiment(run_async, 12, lambda p: None, run_async.__doc__),
    "dynamic": Experiment(run_dynamic, 12, add_seeds_argument, run_dynamic.__doc__),
    "dtype": Experiment(run_dtype, 40, add_dtype_arguments, run_dtype.__doc__),
    "engines": Experiment(run_engines, 6, add_engines_arguments, run_engines.__doc__),
    "routing": Experiment(run_routing, 12, add_routing_arguments, run_routing.__doc__),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="experiment", required=True)
    for name, experiment in EXPERIMENTS.items():
        s = sub.add_parser(name, description=inspect.cleandoc(experiment.description), formatter_class=argparse.RawDescriptionHelpFormatter)
        experiment.add_arguments(s)
        s.add_argument("--steps", type=int, default=experiment.default_steps, help="RL steps per arm")
        s.add_argument("--out", default=os.path.join(REPO, "runs", f"bench_{name}"))
        s.add_argument("--reuse", action="store_true", help="read an arm already run to --steps in --out")
        s.add_argument("extra", nargs="*", help="after --: passed to every train_rl.py run")
    args = p.parse_args(argv)
    if args.steps < 1:
        raise UserError(f"--steps must be >= 1 (got {args.steps})")
    return args


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    EXPERIMENTS[args.experiment].run(args)


if __name__ == "__main__":
    main()
