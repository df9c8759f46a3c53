"""What keeping the running batch in consecutive KV slots saves (EngineConfig.compact_slots).

A GRPO rollout batch drains: requests end at different steps and leave holes in the slots.
With holes, attention gathers every live row's keys and values at every layer of every step;
with compaction the engine moves the last requests into the holes once and reads the cache
through a view. This script generates the same long-tail batches (16 prompts x 8 samples,
T = 1, the task's long-tail variant) with compaction on and off, interleaved, and prints the
engine seconds of each and their ratio (responses are the same either way). Usage:

  python scripts/bench/slot_compaction.py [--hf-checkpoint checkpoints/tiny-mimo-longtail] [--batches 16]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from rollout.embedded.engine import EngineConfig  # noqa: E402
from rollout.embedded.engine_builder import build_engine  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from rollout.task import TASK_VARIANTS  # noqa: E402
from rollout.tokenizer import TextCodec  # noqa: E402
from vime.sample import samples_for_prompts  # noqa: E402

PROMPTS_PER_BATCH, SAMPLES_PER_PROMPT = 16, 8


def rollout_batches(checkpoint, n):
    codec = TextCodec(checkpoint)
    rows = TASK_VARIANTS["longtail"].prompts(PROMPTS_PER_BATCH * n, seed=7)
    ids = [codec.encode_prompt(r["prompt"], 1) for r in rows]
    return [ids[i * PROMPTS_PER_BATCH:(i + 1) * PROMPTS_PER_BATCH] for i in range(n)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint", default="checkpoints/tiny-mimo-longtail")
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = PROMPTS_PER_BATCH * SAMPLES_PER_PROMPT
    engines = {compact: build_engine(args.hf_checkpoint, None, EngineConfig(max_batch_size=rows, compact_slots=compact))
               for compact in (True, False)}
    seconds, same = {True: 0.0, False: 0.0}, 0
    for i, prompts in enumerate(rollout_batches(args.hf_checkpoint, args.batches)):
        sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=i)
        order = (True, False) if i % 2 == 0 else (False, True)  # drift hits both alike
        out = {}
        for compact in order:
            out[compact] = engines[compact].generate(samples_for_prompts(prompts, SAMPLES_PER_PROMPT), sampling)
            seconds[compact] += engines[compact].last_stats["seconds"]
        same += sum(a.response_ids == b.response_ids for a, b in zip(out[True], out[False]))
    print(f"{args.batches} long-tail batches of {rows} rows, {args.threads} thread(s), plain decoding")
    print(f"engine seconds: compact {seconds[True]:.3f}, with holes {seconds[False]:.3f}, "
          f"ratio {seconds[True] / seconds[False]:.3f}; same responses {same} of {rows * args.batches}")


if __name__ == "__main__":
    main()
