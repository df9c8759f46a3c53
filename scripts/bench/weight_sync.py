#!/usr/bin/env python
"""Weight-sync throughput: vime's bucketed broadcast (trainer rank 0 -> rollout workers) and the in-place
hand-over of the same buckets (an engine on the trainer's device) vs an in-process copy of the same
tensors, as ratios measured in one run.

    python scripts/bench/weight_sync.py [--hidden 512] [--layers 8] [--workers 1] [--buffer-mb 16]

Two real processes per worker pair over gloo on loopback: rank 0 holds the named tensors
(policy + MTP, canonical HF names) and `weight_sync.send`s them; each worker `receive`s and
copies them into its model parameters (what `Engine.load_weights` does). The hand-over: rank 0
fills the same buckets in shared memory (the trainer's `InPlaceHandOver`) and sends only the bytes
that map them (over the same group, as a Ray call would carry them); each worker maps them (its
`HandOverReceiver`, once) and copies them into its parameters. The baseline is `param.copy_(tensor)` of the
same tensors inside one process.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
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


def run(rank, args, port, results):
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--buffer-mb", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(1)
    from vime.net import free_port

    results = mp.Manager().dict()
    mp.spawn(run, args=(args, free_port(), results), nprocs=1 + args.workers)
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


if __name__ == "__main__":
    main()
