"""The rollout side of a weight push: what a backend's receiver does, and vime's own bucket receiver.

A push has three steps, each a method of a `WeightReceiver` (the backend hands one out for a
transport, `RolloutBackend.weight_receiver`):

    plan() -> dict                  once, before anyone joins: what the trainer's sender must know
                                    of this engine (picklable; its "sending_end", when present, is
                                    the class the trainer runs to speak the engine's own wire)
    join(rendezvous, rank)          join trainer rank 0's group at `rank` (blocks until all joined);
                                    rendezvous: {"master_addr", "master_port", "world_size", "device"}
    receive(header, version)        one push's tensors into the backend's weights; `header` is what
                                    the sender said a push carries (its `header()`)

`BucketReceiver` is the one every backend can use (--vllm-weight-transfer reload): the flat buckets
of vime/weight_sync.py over a torch.distributed group (gloo on CPU, NCCL on GPU), loaded through the
backend's `load_weights`.
"""
import typing

from vime import weight_sync
from vime.models.draft_kinds import is_draft_name


class WeightReceiver(typing.Protocol):
    """One transport's receiving end inside a rollout worker (see the module docstring)."""

    def plan(self) -> dict: ...

    def join(self, rendezvous: dict, rank: int) -> None: ...

    def receive(self, header, version: int) -> None: ...


class BucketReceiver:
    """vime's bucket broadcast into `load_weights(named, version)`; the header is the bucket layout.

    With keep_draft False (the target-only benchmark arm) the draft's tensors are received but not
    loaded, so the drafter keeps its old weights and the guard reports it stale."""

    def __init__(self, load_weights, num_hidden_layers, keep_draft=True):
        self.load_weights, self.num_hidden_layers, self.keep_draft = load_weights, num_hidden_layers, keep_draft
        self.group, self.device = None, None

    def plan(self):
        return {}

    def join(self, rendezvous, rank):
        self.group, self.device = weight_sync.join_group(rendezvous, rank)

    def receive(self, header, version):
        named = weight_sync.receive(self.group, header, self.device)
        if not self.keep_draft:
            named = ((k, v) for k, v in named if not is_draft_name(k, self.num_hidden_layers))
        self.load_weights(named, version)
