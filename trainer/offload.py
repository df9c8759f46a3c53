"""The trainer's side of memory by turns (--offload-optimizer-state): while the rollout engines generate
on the same device, the optimizers' state waits on the host and the gradients are gone.

What moves: every tensor of an optimizer's per-parameter state (Adam's moments) and, under --bf16, the
fp32 main parameters the optimizer steps (trainer/mixed_precision.py); the model's own parameters stay,
they are what the engines receive. Adam's step counts stay where torch keeps them (the host). Gradients
are freed rather than moved: the next step zeroes them before it accumulates anyway.
"""
import torch


def _state_tensors(optimizer):
    """(holder, key) of every state tensor with elements (Adam's scalar step stays where torch keeps it)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                yield state, key


def _main_params(optimizer):
    """The fp32 main parameters of a --bf16 optimizer (none for a plain one: its parameters are the model's)."""
    if getattr(optimizer, "main_param", None) is None:
        return []
    return [p for group in optimizer.param_groups for p in group["params"]]


def move_optimizer_state(optimizer, device):
    """Every state tensor and main parameter of `optimizer` (and a main parameter's gradient) to `device`."""
    for holder, key in list(_state_tensors(optimizer)):
        holder[key] = holder[key].to(device, non_blocking=True)
    for p in _main_params(optimizer):
        p.data = p.data.to(device, non_blocking=True)
        if p.grad is not None:
            p.grad = p.grad.to(device, non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies are done before either side computes again


def offload(optimizers):
    """Free the gradients and move the optimizers' state to the host."""
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
        move_optimizer_state(optimizer, torch.device("cpu"))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # to the device, for the engines, not kept in torch's cache


def onload(optimizers, device):
    """The optimizers' state back on the trainer's device, before a step."""
    for optimizer in optimizers:
        move_optimizer_state(optimizer, device)
