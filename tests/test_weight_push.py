"""A weight push end to end, without Ray: trainer rank 0's sender from the transport registry
(trainer/weight_senders.py) and a rollout backend's receiver (rollout/weight_receiver.py) meet over a
real gloo group on loopback, and the engine then holds what was sent.

References: vime's checksum and sha256 of the tensors the sender was given (computed on the sending
side, before the wire), and the checkpoint's own draft tensors for the target-only push.
"""
import os
import threading

import pytest
import torch

from rollout.backend import EmbeddedBackend
from trainer.weight_senders import SENDERS
from trainer_fixtures import make_tiny
from vime import weight_sync
from vime.models.draft_kinds import is_draft_name
from vime.models.hf_format import load_hf_checkpoint
from vime.net import free_port

SPEC = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("push_hf")
    make_tiny(path, seed=2, std=0.3)
    return str(path)


def new_weights(ckpt):
    """The checkpoint's canonical tensors, each moved by independent noise (as an RL step moves them)."""
    cfg, state, _ = load_hf_checkpoint(ckpt)
    g = torch.Generator().manual_seed(7)
    return cfg, [(k, v + 0.05 * torch.randn(v.shape, generator=g)) for k, v in state.items()]


def push(receiver, named, buffer_size=1 << 12):
    """One push over a fresh group: rank 0 (the trainer's sender) in a thread, the receiver at rank 1.
    Returns (the sender's header, the bytes it reports sent)."""
    plan = receiver.plan()
    rendezvous = {"master_addr": "127.0.0.1", "master_port": free_port(), "world_size": 2, "device": "cpu"}
    sent, errors = {}, []

    def trainer_rank0():
        try:
            sender = SENDERS["reload"](plan, rendezvous, buffer_size)
            sent["header"] = sender.header(named)
            sent["bytes"], sent["note"] = sender.send(named)
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    thread = threading.Thread(target=trainer_rank0)
    thread.start()
    receiver.join(rendezvous, 1)
    while "header" not in sent and not errors and thread.is_alive():
        thread.join(timeout=0.05)
    if not errors:
        receiver.receive(sent["header"], version=1)
    thread.join(timeout=120)
    assert not errors and not thread.is_alive(), errors
    return sent["header"], sent["bytes"]


def parts(named, num_hidden_layers):
    return ([(k, v) for k, v in named if not is_draft_name(k, num_hidden_layers)],
            [(k, v) for k, v in named if is_draft_name(k, num_hidden_layers)])


def test_a_pushed_update_is_what_the_engine_holds_target_and_draft(ckpt):
    cfg, named = new_weights(ckpt)
    backend = EmbeddedBackend(ckpt, SPEC, 4)
    header, sent_bytes = push(backend.weight_receiver("reload"), named)
    target, draft = parts(named, cfg.num_hidden_layers)
    assert draft, "the checkpoint has MTP layers: the draft is part of the comparison"
    assert backend.fingerprint() == {"target": weight_sync.checksum(target), "draft": weight_sync.checksum(draft)}
    assert backend.digests() == weight_sync.digests(named)  # every tensor, bit for bit
    assert backend.weight_version == 1
    assert sent_bytes == sum(v.numel() * v.element_size() for _, v in named)
    assert len(header) > 1  # small buckets: the update crossed the wire in several broadcasts


def test_a_target_only_push_leaves_the_engines_draft_as_the_checkpoint_had_it(ckpt):
    cfg, named = new_weights(ckpt)
    _, original, _ = load_hf_checkpoint(ckpt)
    backend = EmbeddedBackend(ckpt, SPEC, 4)
    push(backend.weight_receiver("reload", keep_draft=False), named)
    target, draft = parts(named, cfg.num_hidden_layers)
    _, original_draft = parts(list(original.items()), cfg.num_hidden_layers)
    fp = backend.fingerprint()
    assert fp["target"] == weight_sync.checksum(target)
    assert fp["draft"] == weight_sync.checksum(original_draft) != weight_sync.checksum(draft)


def test_every_transport_has_a_sender_and_a_vllm_receiver_and_the_embedded_engine_takes_all_but_nccl(ckpt):
    from rollout.backend import EMBEDDED_RECEIVERS
    from rollout.vllm.backend import RECEIVERS  # imports no vLLM until an engine is built

    assert set(SENDERS) == set(RECEIVERS) == set(EMBEDDED_RECEIVERS) | {"nccl"}
    with pytest.raises(ValueError, match="nccl"):
        EmbeddedBackend(ckpt, SPEC, 4).weight_receiver("nccl")


def _join_and_wait(rendezvous, ready):
    """A group member in a process of its own: it joins, says so, and then takes nothing (the test stops it)."""
    weight_sync.join_group(rendezvous, 2)
    ready.set()
    threading.Event().wait()


def test_an_aborted_push_ends_for_every_member_long_before_glooes_timeout_and_a_new_group_pushes(ckpt):
    """A member that is stopped (SIGSTOP) holds the trainer's broadcast, and through it the other
    engine's receive, until gloo's timeout (5 minutes); once the push is aborted both end within a poll
    with PushBroken, and the trainer and the live engine push again in a new group."""
    import multiprocessing
    import os
    import signal
    import time

    big = [(f"t{i}", torch.full((8 << 20,), float(i))) for i in range(3)]  # 32 MB buckets: past socket buffers
    layout = weight_sync.bucket_layout(big, 32 << 20)
    rendezvous = {"master_addr": "127.0.0.1", "master_port": free_port(), "world_size": 3, "device": "cpu"}
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    member = context.Process(target=_join_and_wait, args=(rendezvous, ready), daemon=True)
    member.start()
    abort, ended = threading.Event(), {}

    def trainer_rank0():
        group, _ = weight_sync.join_group(rendezvous, 0)
        try:
            weight_sync.send(group, layout, big, abort.is_set)
        except weight_sync.PushBroken:
            ended["trainer"] = time.monotonic()
            weight_sync.abandon(group)  # as the sender does: destroying it would wait out gloo's timeout

    trainer = threading.Thread(target=trainer_rank0, daemon=True)
    trainer.start()
    try:
        group, _ = weight_sync.join_group(rendezvous, 1)
        assert ready.wait(120)
        os.kill(member.pid, signal.SIGSTOP)
        aborted_at = []
        threading.Timer(3, lambda: (aborted_at.append(time.monotonic()), abort.set())).start()
        with pytest.raises(weight_sync.PushBroken):
            list(weight_sync.receive(group, layout, aborted=abort.is_set))
        ended["engine"] = time.monotonic()
        weight_sync.abandon(group)
        trainer.join(timeout=60)
    finally:
        os.kill(member.pid, signal.SIGKILL)
    assert set(ended) == {"trainer", "engine"}
    # both ended about a poll after the abort (margin for a loaded machine), far from gloo's timeout
    assert max(ended.values()) - aborted_at[0] < weight_sync.ABORT_POLL_S + 20 < weight_sync.TIMEOUT.total_seconds()

    cfg, named = new_weights(ckpt)  # what the driver does next: a new group, without the lost member
    backend = EmbeddedBackend(ckpt, SPEC, 4)
    push(backend.weight_receiver("reload"), named)
    target, draft = parts(named, cfg.num_hidden_layers)
    assert backend.fingerprint() == {"target": weight_sync.checksum(target), "draft": weight_sync.checksum(draft)}


def test_a_process_that_abandoned_a_push_exits_without_waiting_out_glooes_timeout():
    """The sender gives up on a receiver that never takes the push and abandons the group; its process then ends
    as soon as its work is done, not when gloo's timeout releases the group's threads."""
    import subprocess
    import sys
    import time

    worker, port = os.path.join(os.path.dirname(os.path.abspath(__file__)), "abandoned_push_worker.py"), free_port()
    member = subprocess.Popen([sys.executable, worker, "member", str(port)])
    try:
        started = time.monotonic()
        sender = subprocess.run([sys.executable, worker, "sender", str(port)], capture_output=True, text=True,
                                timeout=weight_sync.TIMEOUT.total_seconds() / 2)
        took = time.monotonic() - started
    finally:
        member.kill()
    assert sender.returncode == 0 and "abandoned" in sender.stdout, sender.stderr[-2000:]
    # start-up, the abort and the exit take seconds; the timeout the exit must not wait for is minutes
    assert took < weight_sync.TIMEOUT.total_seconds() / 3
