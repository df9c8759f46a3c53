#!/usr/bin/env python
"""Trainer step time with routing replay (--use-rollout-routing-replay) against without, interleaved.

One embedded-engine rollout of an MoE checkpoint (its samples carry their routes), then two trainers
of the same checkpoint, one replaying the routes and one not, each taking a training step on that
batch in turn, and who goes first alternates by round: machine load hits both alike, and so does the
first-in-a-round penalty (measured: 1.2-2x on a loaded 2-core machine, whichever steps first). Prints
the median step times, their ratio and the routes' bytes per sample.
"""
import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

from rollout.embedded.engine import EngineConfig  # noqa: E402
from rollout.embedded.engine_builder import build_engine  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from trainer.batch import build_batch  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402
from vime.config import REPO_ROOT  # noqa: E402
from vime.models.routing_replay import route_bytes  # noqa: E402
from vime.sample import samples_for_prompts  # noqa: E402


def rollout_batch(ckpt, prompts, samples_per_prompt, max_new_tokens):
    engine = build_engine(ckpt, {"method": "mtp", "num_speculative_tokens": 2}, EngineConfig(max_batch_size=64))
    prompt_ids = [[1] + [3 + (7 * i + j) % 28 for j in range(4 + i % 5)] for i in range(prompts)]
    samples = samples_for_prompts(prompt_ids, n=samples_per_prompt)
    engine.generate(samples, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=7))
    for i, s in enumerate(samples):
        s.advantage = float(i % 3) - 1.0
    return samples


def alternating_median_step_times(trainers, batch, steps, warmup):
    """Median step time per trainer (two of them), stepping in turn, the first of a round alternating."""
    times = {k: [] for k in trainers}
    keys = list(trainers)
    for i in range(warmup + steps):
        for key in (keys if i % 2 == 0 else keys[::-1]):
            start = time.perf_counter()
            trainers[key].train_step(batch)
            if i >= warmup:
                times[key].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-checkpoint", default=os.path.join(REPO_ROOT, "checkpoints", "tiny-glm4-moe-mtp"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples-per-prompt", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()
    samples = rollout_batch(args.hf_checkpoint, args.prompts, args.samples_per_prompt, args.max_new_tokens)
    batch = build_batch(samples)
    trainers = {replay: Trainer(TrainerConfig(lr=1e-5, enable_mtp_training=True, bf16=args.bf16,
                                              use_rollout_routing_replay=replay), args.hf_checkpoint)
                for replay in (False, True)}
    times = alternating_median_step_times(trainers, batch, args.steps, args.warmup)
    per_sample = sum(route_bytes(s) for s in samples) / len(samples)
    tokens = sum(len(s.tokens) for s in samples) / len(samples)
    print("| batch | step, no replay | step, replay | replay / none | route bytes per sample (tokens) |")
    print("|---|---|---|---|---|")
    print(f"| {len(samples)} samples, {'bf16' if args.bf16 else 'fp32'} | {times[False] * 1e3:.0f} ms "
          f"| {times[True] * 1e3:.0f} ms | {times[True] / times[False]:.3f} | {per_sample:.0f} ({tokens:.1f}) |")


if __name__ == "__main__":
    main()
