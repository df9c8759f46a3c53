#!/usr/bin/env python
"""Multi-head latent attention's cache: KV bytes per token, latent against expanded, greedy unchanged.

    python scripts/bench/mla_cache.py [--hf-checkpoint checkpoints/tiny-deepseek-v3-mtp] [--prompts 32]

Prints the bytes per token the engine's latent cache holds (kv_lora_rank + qk_rope_head_dim per
layer, read from the allocated cache) against a cache of every head's expanded keys and values,
and checks that the engine's greedy tokens (latent cache, absorbed projections) equal
transformers' (keys and values expanded from the latents) on the checkpoint's eval prompts.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from rollout.data import read_jsonl_rows  # noqa: E402
from rollout.embedded.engine import Engine, EngineConfig  # noqa: E402
from rollout.embedded.mla import kv_bytes_per_token  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from rollout.tokenizer import TextCodec  # noqa: E402
from vime.errors import exit_on_user_error, require  # noqa: E402
from vime.sample import samples_for_prompts  # noqa: E402


@exit_on_user_error
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint", default="checkpoints/tiny-deepseek-v3-mtp")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=24)
    args = p.parse_args(argv)
    engine = Engine.from_checkpoint(args.hf_checkpoint, EngineConfig(max_batch_size=args.prompts))
    cfg = engine.cfg
    require(cfg.mla is not None, f"--hf-checkpoint {args.hf_checkpoint}: a {cfg.family} model has no latent attention")
    cache = engine.cache.latent
    allocated = cache[:, 0, 0].numel() * cache.element_size()  # one token, every layer
    latent, expanded = kv_bytes_per_token(cfg, cache.element_size())
    assert allocated == latent
    print(f"KV bytes per token ({cfg.num_hidden_layers} layers, {cache.dtype}): latent {latent}, "
          f"expanded {expanded}, ratio {latent / expanded:.3f}")

    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(args.hf_checkpoint, dtype=torch.float32).eval()
    codec = TextCodec(args.hf_checkpoint)
    rows = [row for _, row in read_jsonl_rows(os.path.join(args.hf_checkpoint, "eval.jsonl"), "eval.jsonl")][:args.prompts]
    prompts = [codec.encode_prompt(r["prompt"], cfg.bos_token_id) for r in rows]
    samples = engine.generate(samples_for_prompts(prompts),
                              SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens, ignore_eos=True))
    equal = 0
    for s in samples:
        out = reference.generate(torch.tensor([s.prompt_ids]), max_new_tokens=args.max_new_tokens,
                                 min_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        equal += out[0, len(s.prompt_ids):].tolist() == s.response_ids
    print(f"greedy tokens equal to transformers' on {equal}/{len(samples)} prompts")
    return 0 if equal == len(samples) else 1


if __name__ == "__main__":
    sys.exit(main())
