"""The rollout side of a weight push: what a backend's receiver does, and vime's own receivers.

A push has three steps, each a method of a `WeightReceiver` (the backend hands one out for a
transport, `RolloutBackend.weight_receiver`):

    plan() -> dict                  once, before anyone joins: what the trainer's sender must know
                                    of this engine (picklable; its "sending_end", when present, is
                                    the class the trainer runs to speak the engine's own wire)
    join(rendezvous, rank)          join trainer rank 0's group at `rank` (blocks until all joined);
                                    rendezvous: {"master_addr", "master_port", "world_size", "device"}
    receive(header, version, note)  one push's tensors into the backend's weights; `header` is what
                                    the sender said a push carries (its `header()`), `note` what it
                                    said with this push (its `send()`'s note, None for most)

`BucketReceiver` is the one every backend can use (--vllm-weight-transfer reload): the flat buckets
of vime/weight_sync.py over a torch.distributed group (gloo on CPU, NCCL on GPU), loaded through the
backend's `load_weights`. `HandOverReceiver` (in_place) maps the same buckets from the trainer's
memory on this device instead: the driver picks it for an engine that shares the trainer's device.
"""
import typing

from vime import weight_sync
from vime.models.draft_kinds import is_draft_name


class WeightReceiver(typing.Protocol):
    """One transport's receiving end inside a rollout worker (see the module docstring)."""

    def plan(self) -> dict: ...

    def join(self, rendezvous: dict, rank: int) -> None: ...

    def receive(self, header, version: int, note=None) -> None: ...


class BucketReceiver:
    """vime's bucket broadcast into `load_weights(named, version)`; the header is the bucket layout.

    With keep_draft False (the target-only benchmark arm) the draft's tensors are received but not
    loaded, so the drafter keeps its old weights and the guard reports it stale."""

    def __init__(self, load_weights, num_hidden_layers, keep_draft=True):
        self.load_weights, self.num_hidden_layers, self.keep_draft = load_weights, num_hidden_layers, keep_draft
        self.group, self.device = None, None
        # set by the rollout worker before a push: whether the driver aborted it, and its sign of life per bucket
        self.aborted, self.progressed = None, None

    def plan(self):
        return {}

    def join(self, rendezvous, rank):
        self.group, self.device = weight_sync.join_group(rendezvous, rank)

    def receive(self, header, version, note=None):
        try:
            self._load(weight_sync.receive(self.group, header, self.device, self.aborted, self.progressed), version)
        except weight_sync.PushBroken:
            weight_sync.abandon(self.group)  # a new group replaces it (the worker joins again)
            self.group = None
            raise

    def _load(self, named, version):
        if not self.keep_draft:
            named = ((k, v) for k, v in named if not is_draft_name(k, self.num_hidden_layers))
        self.load_weights(named, version)


class HandOverReceiver(BucketReceiver):
    """in_place: the trainer's flat buckets mapped where they are (CUDA IPC on a shared GPU, shared
    memory on CPU; the push's note maps them) and loaded through `load_weights`. A GPU's are let go at
    once (the trainer gives that memory back to the device); host buckets, which the trainer refills
    for every push under the same note, stay mapped."""

    def __init__(self, load_weights, num_hidden_layers, keep_draft=True):
        super().__init__(load_weights, num_hidden_layers, keep_draft)
        self.note, self.mapped = None, None

    def join(self, rendezvous, rank):
        """No group: the trainer's memory is on this device already."""

    def receive(self, header, version, note=None):
        mapped = self.mapped if note == self.note else list(weight_sync.take_over(header, note))
        self._load(mapped, version)
        on_host = bool(mapped) and mapped[0][1].device.type == "cpu"
        self.note, self.mapped = (note, mapped) if on_host else (None, None)
