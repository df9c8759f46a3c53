#!/usr/bin/env python
"""Tokens/s of vime's embedded engine vs vLLM (rollout backends), same checkpoint, one run.

    python scripts/bench/engine_vs_vllm.py [--hf-checkpoint DIR] [--new-tokens 64] [--batch-sizes 1,32]

Arms: plain decoding and MTP speculation with k = 1, 2, each at every batch size, greedy, fp32,
`ignore_eos` on both sides (each generates exactly --new-tokens per request); a ratio is printed
only after checking that both generated the same tokens (scripts/bench/same_work.py). Both
run through their rollout backend (rollout/backend.py), as train_rl.py uses them. Without
--hf-checkpoint a random tiny MiMo (TINY_CONFIG) is made: speed does not depend on the weights,
but acceptance does (a random drafter is rarely accepted), so give a pretrained model to see
speculation pay. Prints tokens/s, the ratio embedded / vLLM and each side's acceptance rate and
acceptance length (one definition for both, rollout/spec_stats.py);
ratios within one run tolerate a busy machine, absolute figures do not. vLLM's start-up
(20-60 s) is not timed.
"""
import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # same_work

ARMS = {"plain": None, "mtp k=1": {"method": "mtp", "num_speculative_tokens": 1},
        "mtp k=2": {"method": "mtp", "num_speculative_tokens": 2}}


def timed_generate(backend, prompts, new_tokens):
    """(tokens/s, spec rates, responses) of one timed greedy generate after a warm-up."""
    from vime.sample import samples_for_prompts
    from rollout.sampling_params import SamplingParams
    from rollout.spec_stats import spec_rates
    from same_work import responses

    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    backend.generate(samples_for_prompts(prompts[:2]), params)  # warm-up
    start = time.perf_counter()
    out = backend.generate(samples_for_prompts(prompts), params)
    elapsed = time.perf_counter() - start
    return sum(len(s.response_ids) for s in out) / elapsed, spec_rates(backend.stats()["spec"]), responses(out)


def measure(name, path, spec, prompt_sets, new_tokens):
    from rollout.backend import build_backend

    backend = build_backend(name, path, spec, max(len(p) for p in prompt_sets.values()))
    try:
        return {bs: timed_generate(backend, prompts, new_tokens) for bs, prompts in prompt_sets.items()}
    finally:
        backend.close()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {list(ARMS)}")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the embedded engine")
    args = p.parse_args()

    import torch

    from rollout.task import make_prompts
    from rollout.tiny_model import make_random_checkpoint
    from rollout.tokenizer import TextCodec

    torch.set_num_threads(args.threads)
    path = args.hf_checkpoint or tempfile.mkdtemp()
    if not args.hf_checkpoint:
        make_random_checkpoint(path)
    codec = TextCodec(path)
    rows = make_prompts(64, seed=11)
    prompt_sets = {int(bs): [codec.encode_prompt(r["prompt"], 1) for r in rows[:int(bs)]]
                   for bs in args.batch_sizes.split(",")}
    from same_work import require_same_work

    print(f"{'arm':>8} {'batch':>5} {'embedded tok/s':>15} {'vLLM tok/s':>11} {'ratio':>7} "
          f"{'accept emb':>11} {'accept vLLM':>12} {'length emb':>11} {'length vLLM':>12}", flush=True)
    for arm in args.arms.split(","):
        ours = measure("embedded", path, ARMS[arm], prompt_sets, args.new_tokens)
        theirs = measure("vllm", path, ARMS[arm], prompt_sets, args.new_tokens)
        for bs in prompt_sets:
            (a, st_a, out_a), (b, st_b, out_b) = ours[bs], theirs[bs]
            require_same_work(f"{arm} at batch {bs}", out_a, out_b, greedy=True)
            print(f"{arm:>8} {bs:>5} {a:>15.1f} {b:>11.1f} {a / b:>6.2f}x {st_a['spec_accept_rate']:>11.3f} "
                  f"{st_b['spec_accept_rate']:>12.3f} {st_a['spec_accept_length']:>11.3f} "
                  f"{st_b['spec_accept_length']:>12.3f}", flush=True)


if __name__ == "__main__":
    main()
