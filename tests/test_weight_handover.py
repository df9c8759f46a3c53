"""The in-place hand-over (a trainer rank and an engine on one device) against the bucket path, its
reference: an engine process receives one update both ways — the bucket broadcast over a gloo group,
and the trainer's buckets mapped from shared memory through the bytes Ray would carry — and both
give the same tensors, bit for bit, which are the ones the trainer was given. On CPU the hand-over
maps the trainer's memory (the engine sees a write the trainer makes after the push); on a GPU the
same code hands CUDA IPC handles over (tests/gpu/test_gpu_share.py).

The route rule: an engine that shares trainer rank 0's device (one node, a Ray GPU in common) takes
the hand-over, the others the run's transport; engines sharing a GPU with each other cannot both
join NCCL and are refused in one line."""
import multiprocessing

import pytest
import torch

from orchestration.placement import WeightRoutes
from rollout.backend import EmbeddedBackend
from rollout.weight_receiver import BucketReceiver, HandOverReceiver
from trainer.weight_senders import IN_PLACE, SENDERS
from trainer_fixtures import make_tiny
from vime import weight_sync
from vime.errors import UserError
from vime.net import free_port

BUFFER = 1 << 12  # small buckets: an update of several buckets of each dtype


def update():
    """Canonical-named tensors of two dtypes and odd shapes, as a trainer's push holds them."""
    g = torch.Generator().manual_seed(3)
    named = [(f"model.layers.{i}.w", torch.randn(37, 29, generator=g)) for i in range(4)]
    named += [(f"model.layers.{i}.b", torch.randn(301, generator=g).to(torch.bfloat16)) for i in range(3)]
    return named + [("lm_head.weight", torch.randn(64, 33, generator=g))]


def engine_process(rendezvous, pipe):
    """The engine's side in its own process: the bucket broadcast, then the hand-over of the same update;
    sends back both as {name: host copy}, then reads its mapped memory again when told."""
    got = {}
    bucket = BucketReceiver(lambda named, version: got.setdefault("bucket", {k: v.cpu() for k, v in named}), 0)
    bucket.join(rendezvous, 1)
    bucket.receive(pipe.recv(), version=1)
    kept = []
    mapped = HandOverReceiver(lambda named, version: kept.extend(named), 0)
    mapped.join(None, 1)
    header, note = pipe.recv()  # the bytes a Ray call would carry
    mapped.receive(header, 1, note)
    pipe.send({"bucket": got["bucket"], "in_place": {k: v.cpu().clone() for k, v in kept},
               "devices": sorted({v.device.type for _, v in kept})})
    pipe.recv()  # the trainer wrote into its buckets
    pipe.send({k: v.cpu().clone() for k, v in kept})
    pipe.recv()  # torch passes the tensors' storage as file descriptors this process serves: stay until taken


def both_ways(named, device="cpu"):
    """One update pushed to an engine process both ways: the bucket broadcast over gloo (the reference),
    then the in-place hand-over of the same tensors on `device`. Returns (what the engine got, the bytes
    handed over, the header, what the engine read after the trainer overwrote its buckets)."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    rendezvous = {"master_addr": "127.0.0.1", "master_port": free_port(), "world_size": 2, "device": "cpu"}
    engine = ctx.Process(target=engine_process, args=(rendezvous, theirs))
    engine.start()
    try:
        broadcast = SENDERS["reload"]({}, rendezvous, BUFFER)
        ours.send(broadcast.header(named))
        broadcast.send(named)
        hand_over = SENDERS[IN_PLACE]({}, None, BUFFER)
        on_device = [(k, v.to(device)) for k, v in named]
        header = hand_over.header(on_device)
        size, note = hand_over.send(on_device)
        ours.send((header, note))
        got = ours.recv()
        for bucket in hand_over.buckets:  # the trainer's memory, after the push
            bucket.fill_(7)
        ours.send("wrote")
        seen_after = ours.recv()
        ours.send("taken")
        hand_over.release()
    finally:
        engine.join(timeout=120)
        if engine.is_alive():
            engine.kill()
    assert engine.exitcode == 0
    return got, size, header, seen_after


def test_the_shared_memory_hand_over_delivers_what_the_bucket_broadcast_delivers():
    named = update()
    got, size, header, seen_after = both_ways(named)
    assert len(header) > 2 and size == sum(v.numel() * v.element_size() for _, v in named)
    reference = weight_sync.digests(got["bucket"].items())
    assert weight_sync.digests(got["in_place"].items()) == reference == weight_sync.digests(named)
    assert all(got["in_place"][k].dtype == v.dtype and got["in_place"][k].shape == v.shape for k, v in named)
    # mapped, not copied: the engine read the trainer's own memory
    assert all(bool((v == 7).all()) for v in seen_after.values())


@pytest.mark.slow  # the mechanism's fast test is the one above; this one adds the engine's load_weights
def test_an_engine_takes_a_hand_over_into_its_weights_as_the_bucket_push_loads_them(tmp_path):
    from test_weight_push import SPEC, new_weights, push

    make_tiny(tmp_path, seed=2, std=0.3)
    _, named = new_weights(str(tmp_path))
    by_bucket, in_place = EmbeddedBackend(str(tmp_path), SPEC, 4), EmbeddedBackend(str(tmp_path), SPEC, 4)
    push(by_bucket.weight_receiver("reload"), named)
    sender = SENDERS[IN_PLACE]({}, None, BUFFER)
    header = sender.header(named)
    in_place.weight_receiver(IN_PLACE).receive(header, 1, sender.send(named)[1])
    sender.release()
    assert in_place.digests() == by_bucket.digests() == weight_sync.digests(named)
    assert in_place.fingerprint() == by_bucket.fingerprint() and in_place.weight_version == 1


def at(node, *gpus, device="cpu"):
    return {"node": node, "gpus": [str(g) for g in gpus], "device": device}


def test_engines_on_the_trainers_device_are_handed_over_the_others_take_the_runs_transport():
    routes = WeightRoutes(at("a", 0), [at("a", 0), at("a", 1), at("b", 0), at("a")], "reload")
    assert routes.engines == {IN_PLACE: [0], "reload": [1, 2, 3]}
    # no GPUs anywhere (a CPU cluster): nothing shares a device, every engine joins the group
    assert WeightRoutes(at("a"), [at("a"), at("a")], "nccl").engines == {"nccl": [0, 1]}


def test_two_engines_sharing_a_gpu_away_from_the_trainer_are_refused_in_one_line():
    with pytest.raises(UserError) as err:
        WeightRoutes(at("a", 0, device="cuda"), [at("a", 1, device="cuda"), at("a", 1, device="cuda")], "reload")
    assert "\n" not in str(err.value) and "engines 0 and 1 share a GPU" in str(err.value)
    # on CPU the group is gloo, which joins them
    assert WeightRoutes(at("a", 0), [at("a", 1), at("a", 1)], "reload").engines == {"reload": [0, 1]}
