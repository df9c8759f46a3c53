"""Trainer rank 0's end of a weight push: one sender per transport, by registry.

A sender is built once, on trainer rank 0, from what the rollout engines asked for (their
receiver's `plan()`, rollout/weight_receiver.py) and where to meet them (`rendezvous`:
{"master_addr", "master_port", "world_size", "device"}; the trainer is rank 0 of the group, so
building it blocks until every engine has joined; None for a transport without a group):

    header(named) -> picklable      once, before the first send: what each push carries, which
                                    the engines need with every push (a bucket layout, names and shapes)
    send(named) -> (bytes, note)    one push of (canonical HF name, tensor) pairs, the tensors
                                    where the trainer holds them (a GPU's never visit the host);
                                    `note` goes to the engines with this push (None: they need none)
    release()                       the engines took the push: drop what was kept for them

`needs_gpus`: the transport moves weights between GPUs only (checked before any actor starts).
`automatic`: the driver chooses it by where the engines are, never --vllm-weight-transfer.
The tensors may come from any gathering of the trainer's shards: a sender sees only the pairs.
"""
from vime import weight_sync
from vime.errors import require


class BucketBroadcast:
    """reload: vime's own wire (vime/weight_sync.py): flat buckets of at most --update-weight-buffer-size
    bytes over a torch.distributed group of the trainer and the engines (gloo on CPU, NCCL on GPU);
    each engine loads what arrives its own way (the embedded engine in place, vLLM from shared memory)."""

    needs_gpus, automatic = False, False

    def __init__(self, plan, rendezvous, buffer_size):
        del plan  # every backend takes the buckets as they are
        self.buffer_size, self.layout = buffer_size, None
        self.group, _ = weight_sync.join_group(rendezvous, 0)
        self.aborted = None  # set by the trainer actor before a push: whether the driver aborted it

    def header(self, named):
        self.layout = weight_sync.bucket_layout(named, self.buffer_size)
        return self.layout

    def send(self, named):
        try:
            return weight_sync.send(self.group, self.layout, named, self.aborted), None
        except weight_sync.PushBroken:
            weight_sync.abandon(self.group)  # the driver opens a new sender (a new group) after this
            self.group = None
            raise

    def release(self):
        """Nothing is kept: the broadcast is over when send returns."""


class EngineChannel:
    """nccl: the rollout engine's own GPU-to-GPU channel. The engine's plan names the class that
    speaks it on the trainer's side (its "sending_end"): the engine owns its wire format, the trainer
    hands it the tensors on their device."""

    needs_gpus, automatic = True, False

    def __init__(self, plan, rendezvous, buffer_size):
        del buffer_size  # the engine's channel packs by its own buffer size
        self.end = plan["sending_end"](plan, rendezvous)

    def header(self, named):
        return self.end.header(named)

    def send(self, named):
        return self.end.send(named), None

    def release(self):
        """Nothing is kept: the broadcast is over when send returns."""


class InPlaceHandOver:
    """in_place: engines on the trainer rank's own device (a GPU they share, where NCCL cannot join
    them, or the same machine's memory on CPU) map the trainer's flat buckets (the bucket path's
    layout) through CUDA IPC handles or shared memory: no group, no trip through the host. The
    note of a push is what maps them. On a GPU the buckets live from `send` to `release` (their
    memory goes back to the device for the trainer's turn); on CPU they stay, refilled by each push
    and mapped once by the engines."""

    needs_gpus, automatic = False, True

    def __init__(self, plan, rendezvous, buffer_size):
        del plan, rendezvous  # every backend takes the buckets as they are; no group to meet in
        self.buffer_size, self.layout, self.buckets, self.note = buffer_size, None, None, None

    def header(self, named):
        self.layout = weight_sync.bucket_layout(named, self.buffer_size)
        return self.layout

    def send(self, named):
        kept = self.buckets
        self.buckets = weight_sync.fill_buckets(self.layout, named, kept)
        if kept is None:
            self.note = weight_sync.share(self.buckets)
        return sum(b.numel() * b.element_size() for b in self.buckets), self.note

    def release(self):
        if self.buckets and self.buckets[0].device.type == "cuda":
            self.buckets = self.note = None
            import torch

            torch.cuda.ipc_collect()  # give back the blocks the engines have let go of


IN_PLACE = "in_place"
SENDERS = {"reload": BucketBroadcast, "nccl": EngineChannel, IN_PLACE: InPlaceHandOver}  # by transport


def check_weight_transfer(rollout_cfg):
    """--vllm-weight-transfer: a transport one may choose (not the in-place hand-over, which the driver
    chooses by where the engines are), and nccl only into vLLM (it is vLLM's engine)."""
    t = rollout_cfg.vllm_weight_transfer
    chosen = [name for name, sender in SENDERS.items() if not sender.automatic]
    require(t in chosen, f"--vllm-weight-transfer {t!r}: choose one of {', '.join(chosen)}" +
            (" (in_place is chosen by itself for an engine on the trainer's own device)" if t in SENDERS else ""))
    require(t == "reload" or rollout_cfg.backend == "vllm",
            f"--vllm-weight-transfer {t} is vLLM's weight transfer engine: use it with --rollout-backend vllm")
