"""Speculative-decoding benchmark on the tiny model and its task prompts.

For each method (none, mtp k=1..3, ngram, suffix, draft_model) and batch size, generate
greedy responses to the same prompts and report tokens/s, tokens per target forward
(acceptance length), acceptance rate per draft position and speedup vs `none` measured in
the same run. `mtp adaptive` is MTP with --spec-adaptive (k in 0..3 per batch size); each batch
size ends with its tokens/s against the best fixed k in 0..3 (none = k 0). Every request
generates --max-new-tokens tokens (EOS ignored), and a batch size's rows are printed only after
checking that every method generated as many tokens as the first (greedy: the same tokens;
scripts/bench/same_work.py). Usage:
  python scripts/bench/spec_decode.py --hf-checkpoint checkpoints/tiny-mimo-mtp [--num-prompts 64]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # same_work

import torch  # noqa: E402

from rollout.embedded.engine import EngineConfig  # noqa: E402
from vime.sample import samples_for_prompts  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from rollout.embedded.engine_builder import build_engine, build_proposer  # noqa: E402
from rollout.spec_config import parse_spec_config  # noqa: E402
from rollout.spec_stats import aggregate_spec_stats  # noqa: E402
from rollout.task import make_prompts  # noqa: E402
from rollout.tokenizer import TextCodec  # noqa: E402
from same_work import require_same_work, responses  # noqa: E402


def methods(draft, rejection):
    table = {
        "none": None,
        "mtp k=1": {"method": "mtp", "num_speculative_tokens": 1},
        "mtp k=2": {"method": "mtp", "num_speculative_tokens": 2},
        "mtp k=3": {"method": "mtp", "num_speculative_tokens": 3},
        "mtp adaptive": {"method": "mtp", "num_speculative_tokens": 3},
        "ngram k=3": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
        "suffix k=3": {"method": "suffix", "num_speculative_tokens": 3},
        "draft_model k=3": {"method": "draft_model", "num_speculative_tokens": 3, "model": draft},
    }
    return {name: spec and dict(spec, rejection_sample_method=rejection) for name, spec in table.items()}


ADAPTIVE = {"mtp adaptive"}  # methods run with --spec-adaptive
FIXED_K = ("none", "mtp k=1", "mtp k=2", "mtp k=3")  # what adaptive k must match (within 5 %)


def timed_generate(engine, spec, prompts, sampling):
    # a fresh proposer per repeat: suffix decoding would otherwise replay the previous repeat
    # (the k policy is kept: an adaptive engine keeps its cost profile and acceptance estimate)
    engine.set_proposer(build_proposer(parse_spec_config(spec) if spec is not None else None), engine.k_policy)
    samples = samples_for_prompts(prompts)
    start = time.perf_counter()
    engine.generate(samples, sampling)
    return time.perf_counter() - start, samples


def bench_batch(ckpt, table, names, prompts, batch, sampling, repeats):
    """Best-of-`repeats` seconds per method, methods interleaved within each repeat so that
    load from other jobs on a shared machine hits every method alike."""
    engines = {name: build_engine(ckpt, table[name], EngineConfig(max_batch_size=batch), adaptive=name in ADAPTIVE)
               for name in names}
    for name in names:
        engines[name].generate(samples_for_prompts(prompts[:batch]), sampling)  # warm-up
    best, stats = {}, {}
    for _ in range(repeats):
        for name in names:
            seconds, samples = timed_generate(engines[name], table[name], prompts, sampling)
            best[name] = min(best.get(name, seconds), seconds)
            tokens = sum(len(s.response_ids) for s in samples)
            stats[name] = (tokens, aggregate_spec_stats(samples), responses(samples))
    return {name: (stats[name][0] / best[name], stats[name][1], stats[name][2]) for name in names}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint", default="checkpoints/tiny-mimo-mtp")
    p.add_argument("--draft-model", default=None, help="draft_model checkpoint (default: the target itself)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; RL rollouts use 1")
    p.add_argument("--rejection-sample-method", default="probabilistic", choices=["strict", "probabilistic"])
    p.add_argument("--methods", default=None, help="comma-separated subset of the method names")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    codec = TextCodec(args.hf_checkpoint)
    prompts = [[1] + codec.encode(r["prompt"]) for r in make_prompts(args.num_prompts, seed=1234)]
    print(f"checkpoint {args.hf_checkpoint}")
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    table = methods(args.draft_model or args.hf_checkpoint, args.rejection_sample_method)
    wanted = args.methods.split(",") if args.methods else list(table)
    print(f"temperature {args.temperature}, {args.num_prompts} prompts, max {args.max_new_tokens} new tokens, "
          f"{args.threads} thread(s), best of {args.repeats} (methods interleaved)")
    print("| batch | method | tokens/s | speedup | tokens/forward | accept rate | per position |")
    print("|---|---|---|---|---|---|---|")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        results = bench_batch(args.hf_checkpoint, table, wanted, prompts, batch, sampling, args.repeats)
        base = results[wanted[0]][0]
        for name in wanted[1:]:
            require_same_work(f"{name} vs {wanted[0]} at batch {batch}", results[name][2], results[wanted[0]][2],
                              greedy=args.temperature == 0)
        for name in wanted:
            tps, st, _ = results[name]
            pos = " / ".join(f"{st[k]:.2f}" for k in sorted(st) if k.startswith("spec_accept_rate_pos_"))
            print(f"| {batch} | {name} | {tps:.0f} | {tps / base:.2f}x | {st['spec_accept_length']:.2f} | "
                  f"{st['spec_accept_rate']:.2f} | {pos or '-'} |", flush=True)
        fixed = [n for n in FIXED_K if n in results]
        for name in [n for n in wanted if n in ADAPTIVE and fixed]:
            best = max(fixed, key=lambda n: results[n][0])
            ratio = results[name][0] / results[best][0]
            print(f"batch {batch}: {name} / best fixed k ({best}) = {ratio:.3f}", flush=True)

if __name__ == "__main__":
    main()
