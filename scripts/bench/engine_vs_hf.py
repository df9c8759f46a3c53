#!/usr/bin/env python
"""Tokens/s of vime's embedded engine vs transformers `generate`, greedy, same model, one run.

    python scripts/bench/engine_vs_hf.py [--hf-checkpoint DIR] [--new-tokens 64]

Without --hf-checkpoint a random-weight tiny model (TINY_CONFIG) is made in a temp dir; speed
does not depend on the weights. Both sides generate exactly --new-tokens tokens per request
(EOS ignored on both); the ratio engine / transformers is printed only after checking that both
generated the same tokens (scripts/bench/same_work.py).
"""
import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # same_work

import torch  # noqa: E402

from rollout.embedded.engine import Engine, EngineConfig  # noqa: E402
from vime.sample import samples_for_prompts  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from rollout.task import make_prompts  # noqa: E402
from rollout.tiny_model import make_random_checkpoint  # noqa: E402
from rollout.tokenizer import TextCodec  # noqa: E402
from same_work import require_same_work, responses  # noqa: E402


def engine_tokens_per_s(path, prompts, new_tokens):
    engine = Engine.from_checkpoint(path, EngineConfig(max_batch_size=len(prompts)))
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(samples_for_prompts(prompts[:2]), params)  # warm-up
    start = time.perf_counter()
    out = engine.generate(samples_for_prompts(prompts), params)
    return sum(len(s.response_ids) for s in out) / (time.perf_counter() - start), responses(out)


def hf_tokens_per_s(path, prompts, new_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    model.generation_config.eos_token_id = None  # EOS ignored, as on the engine's side
    kw = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:1], attention_mask=mask[:1], **kw)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
    return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - start), out[:, width:].tolist()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for both sides (1 is fastest for a tiny model and least noisy)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = args.hf_checkpoint or tempfile.mkdtemp()
    if not args.hf_checkpoint:
        make_random_checkpoint(path)
    codec = TextCodec(path)
    rows = make_prompts(64, seed=11)
    print(f"{'batch':>5} {'engine tok/s':>13} {'HF tok/s':>10} {'ratio':>7}")
    for bs in [int(x) for x in args.batch_sizes.split(",")]:
        prompts = [codec.encode_prompt(r["prompt"], 1) for r in rows[:bs]]
        ours, ours_out = engine_tokens_per_s(path, prompts, args.new_tokens)
        theirs, theirs_out = hf_tokens_per_s(path, prompts, args.new_tokens)
        require_same_work(f"batch {bs}", ours_out, theirs_out, greedy=True)
        print(f"{bs:>5} {ours:>13.1f} {theirs:>10.1f} {ours / theirs:>6.2f}x")


if __name__ == "__main__":
    main()
