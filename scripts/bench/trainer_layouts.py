#!/usr/bin/env python
"""What each trainer layout and each optimizer option costs on CPU: step time and bytes per rank.

Every layout trains the same global batch of the same MoE checkpoint (with its MTP layer trained) for
the same steps; each layout's ranks are processes joined over gloo, one thread each, the batch split
over the data-parallel ranks (the routed experts over EP, each expert over ETP, the layers over PP, the
sequence over TP under sequence parallelism). Layouts the trainer refuses for the model are listed as
refused with the reason. The first table: one markdown row per layout, median step time (the slowest
rank's) and parameter bytes held per rank (the largest rank's: parameters and the buffers synced with
them), each as a ratio to one rank's measured in the same run. The second (`--options`): megatron-core's
optimizer options (trainer/optimizer.py) and recompute at DP2, each against the plain optimizer at DP2 in
the same precision measured in the same run: step time, the bytes a rank holds (weights, gradients and
optimizer state on the device; the optimizer state CPU offload moves to the host), and the share of the
step the gradient reduce takes (megatron's finish_grad_sync and the sums after it; with
--overlap-grad-reduce what is left of it after the backward pass). On a machine with fewer cores than
ranks the ranks share cores: the figures say what a layout costs here, not how it scales.
"""
import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from vime.config import REPO_ROOT  # noqa: E402

# name -> (ranks, layout sizes beyond DP); data parallelism fills the ranks the others leave; the tiny MoE
# models' 5 decoder layers split over two pipeline stages as 3 + 2 (the MTP layer beside the last two)
LAYOUTS = {
    "1 rank": (1, {}),
    "DP2": (2, {}),
    "TP2": (2, {"tp": 2}),
    "PP2": (2, {"pp": 2, "last_stage_layers": 2}),
    "EP2": (2, {"ep": 2}),
    "ETP2": (2, {"etp": 2}),
    "DP4": (4, {}),
    "EP4": (4, {"ep": 4}),
    "EP2 x DP4": (4, {"ep": 2}),
    "EP2 x ETP2": (4, {"ep": 2, "etp": 2}),
    "PP2 x EP2 x DP2": (4, {"pp": 2, "ep": 2, "last_stage_layers": 2}),
    "TP2 x EP2": (4, {"tp": 2, "ep": 2}),
    "TP2 + SP x EP2": (2, {"tp": 2, "sp": True, "ep": 2, "etp": 1}),
    "TP2 + SP x PP2 x EP2": (4, {"tp": 2, "sp": True, "pp": 2, "ep": 2, "etp": 1, "last_stage_layers": 2}),
}
BF16_OFFLOAD = {"bf16": True, "use_distributed_optimizer": True, "optimizer_cpu_offload": True}
# option -> (the plain run it is measured against, TrainerConfig settings), all at DP2
OPTIONS = {
    "plain (fp32)": (None, {}),
    "--overlap-grad-reduce": ("plain (fp32)", {"overlap_grad_reduce": True}),
    "--use-distributed-optimizer": ("plain (fp32)", {"use_distributed_optimizer": True}),
    "recompute full (uniform 1)": ("plain (fp32)", {"recompute_granularity": "full", "recompute_method": "uniform",
                                                    "recompute_num_layers": 1}),
    "recompute selective": ("plain (fp32)", {"recompute_granularity": "selective"}),
    "plain (--bf16)": (None, {"bf16": True}),
    "distributed + CPU offload 1.0": ("plain (--bf16)", BF16_OFFLOAD),
    "distributed + CPU offload 0.5": ("plain (--bf16)", {**BF16_OFFLOAD, "optimizer_offload_fraction": 0.5}),
    "+ precision-aware (bf16 main grads)": ("plain (--bf16)", {**BF16_OFFLOAD, "use_precision_aware_optimizer": True,
                                                               "main_grads_dtype": "bf16"}),
}


def layout_of(ranks, sizes):
    """The ParallelLayout of `ranks` trainer processes with `sizes` (TP, PP, EP, ETP), DP filling the rest."""
    from vime.parallel_layout import ParallelLayout

    return ParallelLayout(**sizes, dp=ranks // (sizes.get("tp", 1) * sizes.get("pp", 1)))


def refusal(ckpt, layout):
    """Why the trainer refuses the layout for this checkpoint (its pre-start check's one line), or None."""
    from vime.errors import UserError
    from vime.models.hf_format import read_config

    try:
        layout.check_model(read_config(ckpt))
    except UserError as e:
        return str(e).split(";")[0]
    return None


def timed(part, spent):
    """`part`'s finish_gradients, adding the seconds it takes to `spent` (a one-item list)."""
    finish = part.finish_gradients

    def finish_timed(*args, **kwargs):
        start = time.perf_counter()
        finish(*args, **kwargs)
        spent[0] += time.perf_counter() - start
    part.finish_gradients = finish_timed


def rank_main(rank, port, ckpt, layout, n_samples, steps, warmup, out, settings=None):
    """One rank: warm-up steps, then `steps` timed ones (barrier to barrier, so the slowest rank's)."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from trainer.batch import build_batch
    from trainer.config import TrainerConfig
    from trainer.distributed import init_distributed, teardown
    from trainer.optimizer import held_bytes
    from trainer.trainer import Trainer
    from vime.parallel_layout import FIELDS

    torch.set_num_threads(1)
    init_distributed(rank, layout.world_size, "127.0.0.1", port, layout)
    sizes = {attr: getattr(layout, k) for k, attr in FIELDS.items()}
    trainer = Trainer(TrainerConfig(lr=1e-4, enable_mtp_training=True, micro_batch_size=4, **sizes,
                                    **(settings or {})), ckpt)
    batch = build_batch(synthetic_samples(n_samples)[layout.dp_rank(rank)::layout.dp])
    times, reduce = [], [0.0]
    for part in trainer.parts:
        timed(part, reduce)
    for i in range(warmup + steps):
        dist.barrier()
        start, reduce[0] = time.perf_counter(), 0.0
        trainer.train_step(batch)
        dist.barrier()
        if i >= warmup:
            times.append((time.perf_counter() - start, reduce[0]))
    held = held_bytes(trainer.model, trainer.parts)
    per_rank = [None] * layout.world_size
    dist.all_gather_object(per_rank, held)
    if rank == 0:
        step, spent = min(times, key=lambda t: abs(t[0] - statistics.median(s for s, _ in times)))
        largest = max(per_rank, key=lambda h: h["weights"] + h["gradients"] + h["optimizer"])
        torch.save({"step_s": step, "reduce_share": spent / step, "bytes": max(h["weights"] for h in per_rank),
                    "device": largest["weights"] + largest["gradients"] + largest["optimizer"],
                    "host": max(h["optimizer_host"] for h in per_rank)}, out)
    teardown()


def synthetic_samples(n, prompt_len=8, response_len=24, vocab=32, seed=0):
    """`n` scored samples of random tokens (the same on every rank and in every layout)."""
    from vime.sample import Sample

    g = torch.Generator().manual_seed(seed)
    return [Sample(prompt_ids=torch.randint(3, vocab, (prompt_len,), generator=g).tolist(),
                   response_ids=torch.randint(3, vocab, (response_len,), generator=g).tolist(),
                   rollout_logprobs=[-3.0] * response_len, advantage=float(i % 3) - 1.0) for i in range(n)]


def measure(ckpt, layout, args, settings=None):
    from vime.net import free_port

    out = os.path.join(args.tmp, "layout.pt")
    mp.spawn(rank_main, args=(free_port(), ckpt, layout, args.samples, args.steps, args.warmup, out, settings),
             nprocs=layout.world_size, join=True)
    return torch.load(out)


def option_rows(args):
    """The second table: each option at DP2 against the plain optimizer at DP2, measured here."""
    layout, got = layout_of(2, {}), {}
    print("| option (DP2) | step | vs plain | reduce share | bytes per rank (device) | vs plain | host |")
    print("|---|---|---|---|---|---|---|")
    for name, (plain, settings) in OPTIONS.items():
        got[name] = measure(args.hf_checkpoint, layout, args, settings)
        base = got[plain or name]
        print(f"| {name} | {got[name]['step_s'] * 1e3:.0f} ms | {got[name]['step_s'] / base['step_s']:.2f}x "
              f"| {got[name]['reduce_share'] * 100:.0f} % | {got[name]['device'] / 2**20:.2f} MiB "
              f"| {got[name]['device'] / base['device']:.2f}x | {got[name]['host'] / 2**20:.2f} MiB |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-checkpoint", default=os.path.join(REPO_ROOT, "checkpoints", "tiny-glm4-moe-mtp"))
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names of LAYOUTS")
    ap.add_argument("--samples", type=int, default=16, help="the global batch (4 per micro-batch)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tmp", default="/tmp")
    ap.add_argument("--options", action="store_true", help="the optimizer options' table instead of the layouts'")
    args = ap.parse_args()
    if args.options:
        print(f"{os.path.basename(args.hf_checkpoint.rstrip('/'))}: global batch {args.samples} x 32 tokens, "
              f"the median of {args.steps} steps")
        option_rows(args)
        return
    names = args.layouts.split(",")
    base = measure(args.hf_checkpoint, layout_of(1, {}), args)
    print(f"{os.path.basename(args.hf_checkpoint.rstrip('/'))}: global batch {args.samples} x 32 tokens, "
          f"median of {args.steps} steps")
    print("| layout | ranks | step | vs 1 rank | parameter bytes per rank | vs 1 rank |")
    print("|---|---|---|---|---|---|")
    for name in names:
        ranks, sizes = LAYOUTS[name]
        layout = layout_of(ranks, sizes)
        why = refusal(args.hf_checkpoint, layout)
        if why is not None:
            print(f"| {name} | {ranks} | refused: {why} | | | |", flush=True)
            continue
        got = base if ranks == 1 else measure(args.hf_checkpoint, layout, args)
        print(f"| {name} | {ranks} | {got['step_s'] * 1e3:.0f} ms | {got['step_s'] / base['step_s']:.2f}x "
              f"| {got['bytes'] / 2**20:.2f} MiB | {got['bytes'] / base['bytes']:.2f}x |", flush=True)

if __name__ == "__main__":
    main()
