#!/usr/bin/env python
"""What each trainer layout costs on CPU: step time and per-rank parameter bytes at 1, 2 and 4 ranks.

Every layout trains the same global batch of the same MoE checkpoint (with its MTP layer trained) for
the same steps; each layout's ranks are processes joined over gloo, one thread each, the batch split
over the data-parallel ranks (the routed experts over EP, each expert over ETP, the layers over PP).
Layouts the trainer refuses for the model (e.g. TP on a MoE model) are listed as refused with the
reason. Prints one markdown row per layout: median step time (the slowest rank's), parameter bytes
held per rank (the largest rank's: parameters and the buffers synced with them), each as a ratio to
one rank's measured in the same run. On a machine with fewer cores than ranks the ranks share cores:
the figures say what a layout costs here, not how it scales.
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


def rank_main(rank, port, ckpt, layout, n_samples, steps, warmup, out):
    """One rank: warm-up steps, then `steps` timed ones (barrier to barrier, so the slowest rank's)."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from trainer.batch import build_batch
    from trainer.config import TrainerConfig
    from trainer.distributed import init_distributed, teardown
    from trainer.trainer import Trainer
    from trainer.model import named_weights
    from vime.parallel_layout import FIELDS

    torch.set_num_threads(1)
    init_distributed(rank, layout.world_size, "127.0.0.1", port, layout)
    sizes = {attr: getattr(layout, k) for k, attr in FIELDS.items()}
    trainer = Trainer(TrainerConfig(lr=1e-4, enable_mtp_training=True, micro_batch_size=4, **sizes), ckpt)
    batch = build_batch(synthetic_samples(n_samples)[layout.dp_rank(rank)::layout.dp])
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step(batch)
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    held = sum(t.numel() * t.element_size() for _, t in named_weights(trainer.model, copies=True))
    per_rank = [None] * layout.world_size
    dist.all_gather_object(per_rank, held)
    if rank == 0:
        torch.save({"step_s": statistics.median(times), "bytes": max(per_rank)}, out)
    teardown()


def synthetic_samples(n, prompt_len=8, response_len=24, vocab=32, seed=0):
    """`n` scored samples of random tokens (the same on every rank and in every layout)."""
    from vime.sample import Sample

    g = torch.Generator().manual_seed(seed)
    return [Sample(prompt_ids=torch.randint(3, vocab, (prompt_len,), generator=g).tolist(),
                   response_ids=torch.randint(3, vocab, (response_len,), generator=g).tolist(),
                   rollout_logprobs=[-3.0] * response_len, advantage=float(i % 3) - 1.0) for i in range(n)]


def measure(ckpt, layout, args):
    from vime.net import free_port

    out = os.path.join(args.tmp, "layout.pt")
    mp.spawn(rank_main, args=(free_port(), ckpt, layout, args.samples, args.steps, args.warmup, out),
             nprocs=layout.world_size, join=True)
    return torch.load(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-checkpoint", default=os.path.join(REPO_ROOT, "checkpoints", "tiny-glm4-moe-mtp"))
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names of LAYOUTS")
    ap.add_argument("--samples", type=int, default=16, help="the global batch (4 per micro-batch)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tmp", default="/tmp")
    args = ap.parse_args()
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
