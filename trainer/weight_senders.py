"""Trainer rank 0's end of a weight push: one sender per transport (--vllm-weight-transfer), by registry.

A sender is built once, on trainer rank 0, from what the rollout engines asked for (their
receiver's `plan()`, rollout/weight_receiver.py) and where to meet them (`rendezvous`:
{"master_addr", "master_port", "world_size", "device"}; the trainer is rank 0 of the group, so
building it blocks until every engine has joined):

    header(named) -> picklable      once, before the first send: what each push carries, which
                                    the engines need with every push (a bucket layout, names and shapes)
    send(named) -> bytes sent       one push of (canonical HF name, tensor) pairs, the tensors
                                    where the trainer holds them (a GPU's never visit the host)

`needs_gpus`: the transport moves weights between GPUs only (checked before any actor starts).
"""
from vime import weight_sync


class BucketBroadcast:
    """reload: vime's own wire (vime/weight_sync.py): flat buckets of at most --update-weight-buffer-size
    bytes over a torch.distributed group of the trainer and the engines (gloo on CPU, NCCL on GPU);
    each engine loads what arrives its own way (the embedded engine in place, vLLM from shared memory)."""

    needs_gpus = False

    def __init__(self, plan, rendezvous, buffer_size):
        del plan  # every backend takes the buckets as they are
        self.buffer_size, self.layout = buffer_size, None
        self.group, _ = weight_sync.join_group(rendezvous, 0)

    def header(self, named):
        self.layout = weight_sync.bucket_layout(named, self.buffer_size)
        return self.layout

    def send(self, named):
        return weight_sync.send(self.group, self.layout, named)


class EngineChannel:
    """nccl: the rollout engine's own GPU-to-GPU channel. The engine's plan names the class that
    speaks it on the trainer's side (its "sending_end"): the engine owns its wire format, the trainer
    hands it the tensors on their device."""

    needs_gpus = True

    def __init__(self, plan, rendezvous, buffer_size):
        del buffer_size  # the engine's channel packs by its own buffer size
        self.end = plan["sending_end"](plan, rendezvous)

    def header(self, named):
        return self.end.header(named)

    def send(self, named):
        return self.end.send(named)


SENDERS = {"reload": BucketBroadcast, "nccl": EngineChannel}  # --vllm-weight-transfer
