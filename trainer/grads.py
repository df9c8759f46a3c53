"""Gradient reductions and TP-aware grad-norm clipping for the plain-torch optimizer path.

Megatron's own optimizer (distributed optimizer) is unreliable on gloo, so vime reduces
gradients itself: q/k-layernorm grads are partial sums per TP rank (megatron's
`_allreduce_non_tensor_model_parallel_grads` rule), and the loss is normalised by the
step's global token count, so DP ranks sum their gradients.
"""
import math

import torch
import torch.distributed as dist

from trainer.distributed import collective_device, dp_group, tp_group, tp_rank_and_size

_TP_PARTIAL = ("q_layernorm", "k_layernorm")


def reduce_gradients(named_params):
    """All-reduce (sum) qk-layernorm grads over TP and every grad over DP."""
    _, tp = tp_rank_and_size()
    dp = dist.get_world_size(dp_group())
    for name, p in named_params:
        if p.grad is None:
            continue
        if tp > 1 and any(k in name for k in _TP_PARTIAL):
            dist.all_reduce(p.grad, group=tp_group())
        if dp > 1:
            dist.all_reduce(p.grad, group=dp_group())


def _counted_once(param, tp_rank):
    """Sharded params count on every rank; replicated ones only on TP rank 0."""
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def grad_norm(params):
    """L2 norm of the grads of `params` over the whole (TP-sharded) model."""
    tp_rank, tp = tp_rank_and_size()
    sq = torch.zeros((), dtype=torch.float64, device=collective_device())  # NCCL reduces CUDA tensors only
    for p in params:
        if p.grad is not None and _counted_once(p, tp_rank):
            sq += p.grad.detach().double().pow(2).sum().to(sq.device)
    if tp > 1:
        dist.all_reduce(sq, group=tp_group())
    return math.sqrt(sq.item())


def clip_by_norm(params, max_norm):
    """Scale grads of `params` so their global norm is at most max_norm; return the pre-clip norm."""
    params = list(params)
    norm = grad_norm(params)
    if max_norm and max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
