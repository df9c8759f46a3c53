"""The trainer's side of memory by turns: while the rollout engines generate on the same device, what the
trainer holds there waits on the host.

- --offload-optimizer-state: the gradient buffers are freed (megatron's DDP `offload_grad_buffers`: the next
  step zeroes them before it accumulates anyway) and the optimizers' state (Adam's moments, the fp32 main
  weights of a --bf16 or distributed optimizer) goes to the host; the weights stay, they are what the
  engines receive.
- --offload-train (slime's name): the weights too, so the trainer leaves the device with nothing of its own.

A tensor moves by its storage: the storage's bytes are copied to (pinned) host memory and the storage is
freed in place (`resize_(0)`); coming back refills it in place. Every view of it stays valid meanwhile,
which is what megatron's buffers need: a parameter is a view into its DDP buffer under
--use-distributed-optimizer, and the optimizer's shards are views into the parameters. Host-resident
tensors (a CPU-offloaded optimizer's) are left where they are; on a CPU-only machine the device is the host,
so the copies change no placement but the mechanism runs (and is tested) as it does on a GPU.
"""
import contextlib

import torch


def _storage_bytes(storage):
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _tensors(obj):
    """Every tensor in a nest of dicts, lists and tuples."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def inner_optimizers(optimizer):
    """The torch optimizers a megatron optimizer steps (a chain's each; a HybridDeviceOptimizer's sub-optimizers)."""
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(megatron_optimizer, "optimizer", None)
        if inner is None:
            continue
        yield inner
        yield from getattr(inner, "sub_optimizers", [])


def optimizer_tensors(optimizer):
    """The tensors a megatron optimizer holds: its inner optimizers' parameters (main weights) and state."""
    for inner in inner_optimizers(optimizer):
        yield from (p for group in inner.param_groups for p in group["params"])
        yield from _tensors(list(inner.state.values()))


def weight_tensors(module):
    return [*module.parameters(), *module.buffers()]


class OnHost:
    """The storages of `tensors` that live on `device`, copied to the host and freed there until `onload`."""

    def __init__(self, tensors, device, keep=()):
        kept = {t.untyped_storage().data_ptr() for t in keep}
        self.saved, seen = [], set(kept)
        for t in tensors:
            storage = t.untyped_storage()
            if t.device != device or storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            host.copy_(_storage_bytes(storage), non_blocking=True)
            self.saved.append((storage, host))
        _synchronize()  # the copies are done before the storages go
        for storage, _ in self.saved:
            storage.resize_(0)

    @property
    def nbytes(self):
        return sum(host.numel() for _, host in self.saved)

    def onload(self, keep_copies=False):
        """Refill every storage from its host copy; `keep_copies`: keep those for `free` (the storages are only
        read meanwhile, so the copies stay true)."""
        for storage, host in self.saved:
            storage.resize_(host.numel())
            _storage_bytes(storage).copy_(host, non_blocking=True)
        _synchronize()
        if not keep_copies:
            self.saved = []

    def free(self):
        """Free the storages again, their host copies kept from before (`onload(keep_copies=True)`)."""
        for storage, _ in self.saved:
            storage.resize_(0)


def _synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Offloaded:
    """What `offload` moved of the trainer's parts, to bring back with `onload`."""

    def __init__(self, parts, weights):
        self.parts, self.weights = parts, weights
        device = next(parts[0].module.parameters()).device
        model_weights = [t for part in parts for t in weight_tensors(part.module)]
        for part in parts:
            part.optimizer.zero_grad(set_to_none=True)
            part.ddp.offload_grad_buffers(synchronize=torch.cuda.is_available(), empty_cache=False)
        state = [t for part in parts for t in optimizer_tensors(part.optimizer)]
        self.weights_on_host = OnHost(model_weights, device) if weights else None
        # an optimizer's fp32 parameters are the model's own without --bf16: they are weights, not state
        self.state = OnHost(state, device, keep=model_weights)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # to the device, for the engines, not kept in torch's cache

    def onload(self):
        if self.weights_on_host is not None:
            self.weights_on_host.onload()
        self.state.onload()
        for part in self.parts:
            part.ddp.restore_grad_buffers(synchronize=torch.cuda.is_available())

    @contextlib.contextmanager
    def weights_back(self):
        """Within: the weights on the device, to be read (pushed to the engines); then freed there again."""
        if self.weights_on_host is None:
            yield
            return
        self.weights_on_host.onload(keep_copies=True)
        try:
            yield
        finally:
            self.weights_on_host.free()


def offload(parts, weights=False):
    """Free the parts' gradients and move their optimizers' state (with `weights`, their weights too) to the
    host; returns the `Offloaded` to bring them back."""
    return Offloaded(parts, weights)
