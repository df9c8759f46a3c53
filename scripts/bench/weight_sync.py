#!/usr/bin/env python
"""Weight-sync throughput, as ratios measured in one run.

    python scripts/bench/weight_sync.py engines [--workers 1]   # broadcast vs in-place hand-over vs in-process copy
    python scripts/bench/weight_sync.py stages [--stages 2] [--workers 1]  # pipeline stages: gather vs per stage

Both take [--hidden 512] [--layers 8] [--buffer-mb 16]: the tiny model's shape, at that size 105.7 MiB of
canonical HF tensors (policy + MTP).

engines: two real processes per worker pair over gloo on loopback: rank 0 holds the named tensors and
`weight_sync.send`s them; each worker `receive`s and copies them into its model parameters (what
`Engine.load_weights` does). The hand-over: rank 0 fills the same buckets in shared memory (the trainer's
`InPlaceHandOver`) and sends only the bytes that map them (over the same group, as a Ray call would carry
them); each worker maps them (its `HandOverReceiver`, once) and copies them into its parameters. The
baseline is `param.copy_(tensor)` of the same tensors inside one process.

stages: pushing a pipeline-parallel trainer's weights to the engines, P stage processes and N engine
processes over gloo on loopback. The tensors are split as pipeline stages hold them (decoder layers evenly,
the embedding on the first stage, the final norm, the head and the MTP layer on the last). Both arms end
with every engine holding every tensor, loaded into its parameters:
- gather (vime): the stages after the first send theirs to the first stage point to point (vime's own
  `trainer.weights` wire: a header, then one flat buffer per dtype), which then broadcasts every bucket to
  the engines (`vime.weight_sync.send` / `receive`);
- per stage (slime's way): one broadcast group of the P stages and the N engines; each stage broadcasts the
  buckets of its own tensors, in stage order.
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

from rollout.embedded.model import CausalLMWithMTP  # noqa: E402
from rollout.tiny_model import TINY_CONFIG  # noqa: E402
from vime import weight_sync  # noqa: E402

REPEATS = 5


def make_model(args):
    import dataclasses

    cfg = dataclasses.replace(TINY_CONFIG, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                              num_hidden_layers=args.layers, num_attention_heads=args.hidden // 32,
                              num_key_value_heads=max(1, args.hidden // 128), head_dim=32)
    torch.manual_seed(0)
    return CausalLMWithMTP(cfg)


def run_engines(rank, args, port, results):
    torch.set_num_threads(1)
    model = make_model(args)
    named = [(k, v.detach()) for k, v in model.named_parameters()]
    layout = weight_sync.bucket_layout(named, args.buffer_mb * 2 ** 20)
    group = weight_sync.make_group("127.0.0.1", port, rank, 1 + args.workers)
    params = dict(model.named_parameters())
    times = []
    for _ in range(REPEATS):
        group.barrier().wait()
        start = time.perf_counter()
        if rank == 0:
            weight_sync.send(group, layout, named)
        else:
            with torch.no_grad():
                for name, tensor in weight_sync.receive(group, layout):
                    params[name].copy_(tensor)
        group.barrier().wait()
        times.append(time.perf_counter() - start)
    handed = hand_over_seconds(rank, group, layout, named, params)
    if rank == 0:
        results["sync"] = min(times)
        results["hand_over"] = handed
        results["bytes"] = sum(t.numel() * t.element_size() for _, t in named)
        results["buckets"] = len(layout)


def hand_over_seconds(rank, group, layout, named, params):
    """Best of REPEATS of the in-place hand-over (the trainer's InPlaceHandOver, each engine's
    HandOverReceiver): rank 0 fills its shared buckets and broadcasts the bytes that map them, every
    worker's copy into its parameters done. The first push, which creates and maps the buckets, is
    timed too: best of is what every later push costs."""
    from rollout.weight_receiver import HandOverReceiver
    from trainer.weight_senders import IN_PLACE, SENDERS

    def copy_into_params(pairs, version):
        with torch.no_grad():
            for name, tensor in pairs:
                params[name].copy_(tensor)

    sender = SENDERS[IN_PLACE]({}, None, 0) if rank == 0 else None
    receiver = HandOverReceiver(copy_into_params, 0) if rank else None
    if sender:
        sender.layout = layout
    times = []
    for _ in range(REPEATS):
        group.barrier().wait()
        start = time.perf_counter()
        if rank == 0:
            _, note = sender.send(named)
            weight_sync.broadcast(group, torch.tensor([len(note)]))
            weight_sync.broadcast(group, torch.frombuffer(bytearray(note), dtype=torch.uint8))
        else:
            size = weight_sync.broadcast(group, torch.zeros(1, dtype=torch.long))
            note = weight_sync.broadcast(group, torch.empty(int(size), dtype=torch.uint8)).numpy().tobytes()
            receiver.receive(layout, 1, note)
        group.barrier().wait()
        times.append(time.perf_counter() - start)
    return min(times)


def in_process_copy_seconds(args):
    model, target = make_model(args), make_model(args)
    params = dict(target.named_parameters())
    named = [(k, v.detach().clone()) for k, v in model.named_parameters()]
    best = float("inf")
    with torch.no_grad():
        for _ in range(REPEATS):
            start = time.perf_counter()
            for name, tensor in named:
                params[name].copy_(tensor)
            best = min(best, time.perf_counter() - start)
    return best


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


def run_stages(rank, args, ports, results):
    torch.set_num_threads(1)
    world = args.stages + args.workers
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


def engines(args):
    from vime.net import free_port

    results = mp.Manager().dict()
    mp.spawn(run_engines, args=(args, free_port(), results), nprocs=1 + args.workers)
    copy_s = in_process_copy_seconds(args)
    mb = results["bytes"] / 2 ** 20
    print(f"tensors: {mb:.1f} MiB in {results['buckets']} buckets of <= {args.buffer_mb} MiB, "
          f"{args.workers} worker(s), best of {REPEATS}")
    print(f"broadcast sync : {results['sync'] * 1e3:8.1f} ms  {mb / results['sync']:8.1f} MiB/s")
    print(f"in-place hand-over: {results['hand_over'] * 1e3:5.1f} ms  {mb / results['hand_over']:8.1f} MiB/s")
    print(f"in-process copy: {copy_s * 1e3:8.1f} ms  {mb / copy_s:8.1f} MiB/s")
    print(f"ratio sync / in-process copy throughput: {copy_s / results['sync']:.3f}")
    print(f"ratio hand-over / in-process copy throughput: {copy_s / results['hand_over']:.3f}; "
          f"hand-over / broadcast: {results['sync'] / results['hand_over']:.2f}x")


def stages(args):
    from vime.net import free_port

    results = mp.Manager().dict()
    mp.spawn(run_stages, args=(args, [free_port() for _ in range(3)], results), nprocs=args.stages + args.workers,
             join=True)
    mb = results["bytes"] / 2 ** 20
    print(f"{mb:.1f} MiB over {args.stages} stages to {args.workers} engine(s), best of {REPEATS}")
    for arm in ("gather", "per_stage"):
        print(f"  {arm:10s} {results[arm] * 1e3:8.1f} ms  {mb / results[arm]:8.1f} MiB/s")
    print(f"gather / per stage: {results['gather'] / results['per_stage']:.2f}x the time")


MODES = {"engines": engines, "stages": stages}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=list(MODES))
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--workers", type=int, default=1, help="engine processes")
    p.add_argument("--stages", type=int, default=2, help="stages: pipeline stages")
    p.add_argument("--buffer-mb", type=int, default=16)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    MODES[args.mode](args)


if __name__ == "__main__":
    main()
