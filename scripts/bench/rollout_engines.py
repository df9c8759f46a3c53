#!/usr/bin/env python
"""Rollout tokens/s with N rollout engines (--rollout-num-workers) against one, same prompts,
at several batch sizes.

    python scripts/bench/rollout_engines.py [--workers 2] [--steps 6] [--batch-sizes 16,64,128]
                                            [--samples 8] [-- extra train_rl.py flags]

Rollout only (--debug-rollout-only: the same checkpoint weights every step, so both arms sample
the same tokens: every request has its own seeded generator, whichever engine runs it). Each
batch size is a number of prompts per step, each sampled `--samples` times, and one engine may
batch all of them (--rollout-max-batch-size = prompts x samples), so both arms run the same
rows and differ only in how many engines share them. Prints rollout tokens/s per arm from
step 1 on, the ratio, and the generated token counts of both arms; refuses a ratio where the
counts differ. A decode forward has a fixed cost (the Python loop, small kernels) besides its
per-row cost: halving the rows per engine halves only the second, so the gain of a second engine
grows with the batch, towards twice one engine's tokens/s where there is a core for each.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rl_arms import column, fmt, mean_se, run_arm  # noqa: E402


def parse_sizes(text):
    sizes = [int(x) for x in text.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        sys.exit(f"--batch-sizes {text!r}: give positive prompt counts, e.g. 16,64,128")
    return sizes


def run_batch_size(args, prompts):
    """Both arms at one batch size: {engines: metrics rows}."""
    rows = prompts * args.samples
    base = ["--num-rollout", args.steps, "--debug-rollout-only", "--rollout-batch-size", prompts,
            "--n-samples-per-prompt", args.samples, "--rollout-max-batch-size", rows, *args.extra]
    out = os.path.join(args.out, f"b{prompts}")
    return {n: run_arm(f"engines_{n}", out, base + ["--rollout-num-workers", n]) for n in (1, args.workers)}


def generated_tokens(rows):
    return round(sum(r["rollout/response_len"] * r["rollout/num_samples"] for r in rows))


def table_rows(prompts, samples, results):
    """Markdown rows for one batch size; the ratio column says why it is missing if work differs."""
    counts = {n: generated_tokens(rows) for n, rows in results.items()}
    same_work = len(set(counts.values())) == 1
    one = mean_se(column(results[1], "perf/rollout_tokens_per_s", skip=1))[0]
    lines = []
    for n, rows in results.items():
        rate = mean_se(column(rows, "perf/rollout_tokens_per_s", skip=1))
        ratio = f"{rate[0] / one:.2f}" if same_work else "— (token counts differ)"
        lines.append(f"| {prompts} x {samples} | {n} | {fmt(*rate)} | {ratio} | {counts[n]} |")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-sizes", default="16,64,128", help="prompts per step, comma-separated")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (a GRPO group)")
    p.add_argument("--out", default="runs/bench_engines")
    p.add_argument("extra", nargs="*", help="after --: passed to every train_rl.py run")
    args = p.parse_args()
    sizes = parse_sizes(args.batch_sizes)
    lines = []
    for prompts in sizes:
        lines += table_rows(prompts, args.samples, run_batch_size(args, prompts))
    print(f"cores: {os.cpu_count()}")
    print("| prompts x samples | engines | rollout tokens/s (steps 1..) | x one engine | tokens generated |")
    print("|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
