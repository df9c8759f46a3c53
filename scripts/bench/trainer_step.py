#!/usr/bin/env python
"""Trainer step time with and without online MTP training, against the MTP layer's FLOP share.

The MTP share of a training step's FLOPs is analytic (matmul FLOPs per token): the trunk
(layers + LM head) runs forward and a 2x backward; the MTP block (layer + eh_proj) too, and
its LM-head call, whose weight is detached with the trunk, only a 1x backward (input grad).
Two ways to read the same step times, both printed:
  share of the step   (T_mtp - T_plain) / T_mtp  vs  MTP FLOPs / (trunk + MTP FLOPs)
  overhead            T_mtp / T_plain - 1        vs  MTP FLOPs / trunk FLOPs
A perfectly efficient MTP block meets both with equality. (The overhead is *not* to be
compared with the share: a block that is a fraction f of the step's FLOPs adds f / (1 - f) to a step
without it.) One markdown row per run.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from rollout.tiny_model import make_random_checkpoint  # noqa: E402
from trainer.batch import build_batch  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402
from vime.sample import Sample  # noqa: E402


def layer_flops(cfg, seq):
    """Forward matmul FLOPs per token of one decoder layer (projections + attention scores)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    proj = 2 * h * (q + 2 * kv) + 2 * q * h + 3 * 2 * h * cfg.intermediate_size
    return proj + 2 * 2 * cfg.num_attention_heads * d * seq / 2


def train_flops(cfg, seq):
    """(trunk, MTP) matmul FLOPs per token of one training step: forward + backward."""
    head = 2 * cfg.hidden_size * cfg.vocab_size
    trunk = 3 * (cfg.num_hidden_layers * layer_flops(cfg, seq) + head)
    mtp = 3 * (layer_flops(cfg, seq) + 2 * 2 * cfg.hidden_size * cfg.hidden_size) + 2 * head
    return trunk, mtp


def mtp_flop_share(cfg, seq):
    trunk, mtp = train_flops(cfg, seq)
    return mtp / (trunk + mtp)


def batch(n, prompt, response, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = [Sample(prompt_ids=torch.randint(0, vocab, (prompt,), generator=g).tolist(),
                      response_ids=torch.randint(0, vocab, (response,), generator=g).tolist(),
                      rollout_logprobs=[-3.0] * response, advantage=float(i % 3) - 1.0) for i in range(n)]
    return build_batch(samples)


def median_step_times(trainers, b, steps, warmup):
    """Median step time per trainer, steps interleaved so machine load hits both alike."""
    samples = {k: [] for k in trainers}
    for i in range(warmup + steps):
        for key, trainer in trainers.items():
            start = time.perf_counter()
            trainer.train_step(b)
            if i >= warmup:
                samples[key].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in samples.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=96)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as hf:
        cfg = make_random_checkpoint(hf, num_hidden_layers=args.layers, hidden_size=args.hidden,
                                     intermediate_size=args.hidden * 8 // 3, head_dim=32,
                                     num_attention_heads=args.hidden // 32, num_key_value_heads=2)
        b = batch(args.batch, args.prompt_len, args.response_len, cfg.vocab_size)
        trainers = {enable: Trainer(TrainerConfig(lr=1e-5, enable_mtp_training=enable), hf)
                    for enable in (False, True)}
        times = median_step_times(trainers, b, args.steps, args.warmup)
    trunk, mtp = train_flops(cfg, args.prompt_len + args.response_len)
    share, flop_overhead = mtp / (trunk + mtp), mtp / trunk
    overhead = times[True] / times[False] - 1
    step_share = 1 - times[False] / times[True]
    print("| model / batch | step, no MTP | step, MTP | MTP share of step | MTP FLOP share | overhead | "
          "MTP FLOPs / trunk FLOPs |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.layers} layers, hidden {args.hidden}, batch {args.batch}x{args.prompt_len + args.response_len} "
          f"| {times[False] * 1e3:.0f} ms | {times[True] * 1e3:.0f} ms | {step_share:.1%} | {share:.1%} "
          f"| {overhead:.1%} | {flop_overhead:.1%} |")


if __name__ == "__main__":
    main()
