"""Speculation where decoding is memory-bound: a >= 100 M-parameter random model, 1-16 rows.

A random-weight model of the default family (fp32, ~120 M parameters: a decode step streams
~0.5 GB of weights, far more than this CPU's caches) decodes fixed-length responses (EOS off)
with no speculation, and with MTP drafting whose acceptance is set by synthetic verification
to the per-position rates the drift benchmark measured at its end for the frozen and the
online draft (BENCHMARKS.md). Rows = requests in flight, all admitted at once. Prints, per
batch size, tokens/s of none / frozen / online (fixed k) / online with --spec-adaptive, and
the speedups online/none, online/frozen measured in the same run (arms interleaved, best of
--repeats), plus the cost of a verify of 1..4 tokens per row against a plain step.
On a GPU (`--device cuda --dtype bfloat16`) the same arms run where LLM decoding really is
memory- and launch-bound: a verify of a few tokens per row costs about one plain step.
Usage:
  python scripts/bench/spec_scale.py [--batch-sizes 1,2,4,8,16] [--threads 2] [--max-new-tokens 32]
  python scripts/bench/spec_scale.py --device cuda --dtype bfloat16
"""
import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # same_work

import torch  # noqa: E402

from rollout.embedded.engine import EngineConfig  # noqa: E402
from vime.sample import samples_for_prompts  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from rollout.embedded.engine_builder import build_engine  # noqa: E402
from rollout.tiny_model import make_random_checkpoint  # noqa: E402
from same_work import require_same_work, responses  # noqa: E402

# the drift benchmark's end-of-run per-position acceptance (BENCHMARKS.md, MTP drift, k = 2):
# online 0.79 / 0.30; frozen: accept length 1.087 split with the pretrained draft's decay
ONLINE_RATES = "0.79,0.30"
FROZEN_RATES = "0.077,0.010"
# deep and narrow like real LLMs: the MTP layer is 1/16 of this trunk (DeepSeek-V3 1/61, MiMo-7B 1/36);
# --layers 8 --hidden 1024 --intermediate 2816 gives a 1/8 draft
SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=12,
             num_key_value_heads=6, head_dim=64, max_position_embeddings=512)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,2,4,8,16")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: robust on a shared machine)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--online-rates", default=ONLINE_RATES, help="vLLM synthetic_acceptance_rates of the online draft")
    p.add_argument("--frozen-rates", default=FROZEN_RATES, help="... of the frozen draft")
    p.add_argument("--device", default="cpu", help="torch device of the engine (cpu or cuda)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    p.add_argument("--hidden", type=int, default=SHAPE["hidden_size"])
    p.add_argument("--intermediate", type=int, default=SHAPE["intermediate_size"])
    return p.parse_args()


def synthetic_spec(rates):
    rates = [float(r) for r in rates.split(",")]
    return {"method": "mtp", "num_speculative_tokens": len(rates), "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": rates}


def arms(args):
    online, frozen = synthetic_spec(args.online_rates), synthetic_spec(args.frozen_rates)
    return {"none": (None, False), "frozen": (frozen, False), "online": (online, False),
            "online adaptive": (online, True)}


def build(ckpt, spec, adaptive, max_batch, device, dtype):
    config = EngineConfig(max_batch_size=max_batch, device=device, dtype=getattr(torch, dtype))
    engine = build_engine(ckpt, spec, config, adaptive=adaptive)
    return engine


def run(engine, batch, max_new):
    prompts = [[1] + [3 + (7 * i + j) % 20 for j in range(8)] for i in range(batch)]
    start = time.perf_counter()
    # fixed-length responses (EOS ignored): every arm generates the same number of tokens
    samples = engine.generate(samples_for_prompts(prompts),
                              SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True))
    return sum(len(s.response_ids) for s in samples) / (time.perf_counter() - start), responses(samples)


def verify_cost(engine, max_q=4):
    """Milliseconds of one verify forward of 1..max_q tokens at 1 row."""
    return [1e3 * engine.profile_verify(1, q, repeats=5) for q in range(1, max_q + 1)]


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    heads = args.hidden // SHAPE["head_dim"]  # MiMo ties head_dim to hidden / heads
    shape = dict(SHAPE, num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.intermediate,
                 num_attention_heads=heads, num_key_value_heads=heads // 2)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_random_checkpoint(tmp, **shape)
        engines = {name: build(tmp, spec, adaptive, max(batches), args.device, args.dtype) for name, (spec, adaptive) in arms(args).items()}
    for engine in engines.values():  # warm-up, and the adaptive arm's cost profile, outside the timing
        run(engine, max(batches), 4)
    params = sum(p.numel() for p in engines["none"].model.parameters())
    print(f"random {cfg.num_hidden_layers}-layer model + {cfg.num_nextn_predict_layers} MTP layer, "
          f"{params / 1e6:.0f} M parameters {args.dtype} on {args.device}, {args.threads} threads, "
          f"linear backend {engines['none'].fast.backend}, attention {engines['none'].backend}")
    print(f"synthetic acceptance (vLLM synthetic_acceptance_rates): online {args.online_rates}, "
          f"frozen {args.frozen_rates}; {args.max_new_tokens} new tokens per row, greedy, EOS off")
    ms = verify_cost(engines["none"])
    print("verify forward at 1 row, 1..4 tokens: " + " / ".join(f"{t:.1f}" for t in ms) + " ms = "
          + " / ".join(f"{t / ms[0]:.2f}x" for t in ms) + " a plain step")
    k = len(args.online_rates.split(","))
    draft_ms = 1e3 * engines["online"].profile_draft(1, k, repeats=5)
    print(f"drafting {k} tokens at 1 row (MTP catch-up + chain + heads): {draft_ms:.1f} ms = "
          f"{draft_ms / ms[0]:.2f}x a plain step")
    names = list(engines)
    print(f"{'rows':>4} " + " ".join(f"{n + ' tok/s':>20}" for n in names)
          + f" {'online/none':>12} {'online/frozen':>14} {'adaptive/none':>14} {'adaptive k':>11}")
    for b in batches:
        best, outs = {}, {}
        for _ in range(args.repeats):
            for name in names:  # interleaved: a busy machine slows every arm alike
                tps, outs[name] = run(engines[name], b, args.max_new_tokens)
                best[name] = max(best.get(name, 0.0), tps)
        for name in names[1:]:  # synthetic acceptance keeps wrong drafts: equal counts, not tokens
            require_same_work(f"{name} vs {names[0]} at {b} rows", outs[name], outs[names[0]], greedy=False)
        k_mean = engines["online adaptive"].stats().get("spec_k_mean", float("nan"))
        print(f"{b:>4} " + " ".join(f"{best[n]:>20.1f}" for n in names)
              + f" {best['online'] / best['none']:>11.2f}x {best['online'] / best['frozen']:>13.2f}x"
              f" {best['online adaptive'] / best['none']:>13.2f}x {k_mean:>11.2f}")


if __name__ == "__main__":
    main()
