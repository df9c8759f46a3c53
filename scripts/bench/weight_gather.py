#!/usr/bin/env python
"""Pushing a pipeline-parallel trainer's weights to the engines: one rank gathers the stages and pushes
(vime) vs each stage pushing its own layers (slime), as a ratio measured in one run.

    python scripts/bench/weight_gather.py [--hidden 512] [--layers 8] [--stages 2] [--engines 1] [--buffer-mb 16]

P stage processes and N engine processes over gloo on loopback. The model's canonical HF tensors
are split as pipeline stages hold them (decoder layers evenly, the embedding on the first stage,
the final norm, the head and the MTP layer on the last). Both arms end with every engine holding every
tensor, loaded into its parameters:

- gather: the stages after the first send theirs to the first stage point to point (vime's own
  `trainer.weights` wire: a header, then one flat buffer per dtype), which then broadcasts every
  bucket to the engines (`vime.weight_sync.send` / `receive`);
- per stage: one broadcast group of the P stages and the N engines; each stage broadcasts the buckets
  of its own tensors, in stage order.
"""
import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from scripts.bench.weight_sync import make_model  # noqa: E402  (the same model as the weight-sync bench)
from vime import weight_sync  # noqa: E402

REPEATS = 5


def stage_of(name, cfg, stages):
    """The pipeline stage holding HF tensor `name` (layers split evenly; MTP layers on the last stage)."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        layer = int(m.group(1))
        return stages - 1 if layer >= cfg.num_hidden_layers else layer * stages // cfg.num_hidden_layers
    return 0 if "embed_tokens" in name else stages - 1


def broadcast_from(group, tensor, root):
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    group.broadcast([tensor], opts).wait()


def gather_then_push(rank, args, named_by_stage, sync_group):
    from trainer.weights import _recv_pairs, _send_pairs

    stages = args.stages
    if rank < stages:
        if rank > 0:
            _send_pairs(named_by_stage[rank], 0, dist.group.WORLD)
            return None
        everything = list(named_by_stage[0])
        for src in range(1, stages):
            everything += _recv_pairs(src, dist.group.WORLD)
        weight_sync.send(sync_group, args.layout, everything)
        return None
    return list(weight_sync.receive(sync_group, args.layout))


def each_stage_pushes(rank, args, named_by_stage, stage_group):
    received = []
    for stage, layout in enumerate(args.stage_layouts):
        by_name = dict(named_by_stage[stage]) if rank == stage else {}
        for bucket in layout:
            flat = (weight_sync.flatten_bucket(bucket, by_name) if rank == stage else
                    torch.empty(sum(s.numel for s in bucket), dtype=bucket[0].dtype))
            broadcast_from(stage_group, flat, stage)
            if rank >= args.stages:
                received += weight_sync.unflatten_bucket(bucket, flat)
    return received if rank >= args.stages else None


def run(rank, args, ports, results):
    torch.set_num_threads(1)
    world = args.stages + args.engines
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=world)
    model = make_model(args)
    cfg = model.cfg
    named = [(k, v.detach()) for k, v in model.state_dict().items()]
    named_by_stage = [[(k, v) for k, v in named if stage_of(k, cfg, args.stages) == s] for s in range(args.stages)]
    args.layout = weight_sync.bucket_layout([p for s in named_by_stage for p in s], args.buffer_mb * 2 ** 20)
    args.stage_layouts = [weight_sync.bucket_layout(s, args.buffer_mb * 2 ** 20) for s in named_by_stage]
    # the gather arm's push group: the first stage and the engines; the other arm's: every stage and the engines
    sync_ranks = [0, *range(args.stages, world)]
    sync_group = (weight_sync.make_group("127.0.0.1", ports[1], sync_ranks.index(rank), len(sync_ranks))
                  if rank in sync_ranks else None)
    stage_group = weight_sync.make_group("127.0.0.1", ports[2], rank, world)
    params = model.state_dict()
    times = {"gather": [], "per_stage": []}
    for _ in range(REPEATS):
        for arm, push in (("gather", lambda: gather_then_push(rank, args, named_by_stage, sync_group)),
                          ("per_stage", lambda: each_stage_pushes(rank, args, named_by_stage, stage_group))):
            dist.barrier()
            start = time.perf_counter()
            got = push()
            with torch.no_grad():
                for name, tensor in got or ():
                    params[name].copy_(tensor)
            dist.barrier()
            times[arm].append(time.perf_counter() - start)
            if got is not None:
                assert {k for k, _ in got} == set(params), arm
    if rank == 0:
        results.update({arm: min(t) for arm, t in times.items()})
        results["bytes"] = sum(t.numel() * t.element_size() for _, t in named)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--buffer-mb", type=int, default=16)
    args = p.parse_args()
    from vime.net import free_port

    results = mp.Manager().dict()
    mp.spawn(run, args=(args, [free_port() for _ in range(3)], results), nprocs=args.stages + args.engines,
             join=True)
    mb = results["bytes"] / 2 ** 20
    print(f"{mb:.1f} MiB over {args.stages} stages to {args.engines} engine(s), best of {REPEATS}")
    for arm in ("gather", "per_stage"):
        print(f"  {arm:10s} {results[arm] * 1e3:8.1f} ms  {mb / results[arm]:8.1f} MiB/s")
    print(f"gather / per stage: {results['gather'] / results['per_stage']:.2f}x the time")


if __name__ == "__main__":
    main()
