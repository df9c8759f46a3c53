"""Gradient reductions and TP/PP-aware grad-norm clipping for the plain-torch optimizer path.

Megatron's own optimizer (distributed optimizer) is unreliable on gloo, so vime reduces
gradients itself, by megatron's rules: q/k-layernorm grads are partial sums per TP rank
(`_allreduce_non_tensor_model_parallel_grads`); under pipeline parallelism the last stage's copy
of the word embedding and the first stage's sum their grads (`_allreduce_word_embedding_grads`,
the parameters megatron marks `shared_embedding`), so both copies take the same steps; and the
loss is normalised by the step's global token count, so DP ranks sum their gradients. A routed
expert's shard under expert parallelism already holds the gradient of every token the EP ranks sent
it (the dispatcher's reduce-scatter carries them back), so it is summed over the ranks holding the
same shard (expert DP) only. The grad norm counts every weight once: TP shards on every TP rank,
replicated weights on TP rank 0, a routed expert's shard once over the ETP x EP ranks, each stage
its own layers, an embedding copy (megatron's `shared` mark) not at all.
"""
import math

import torch
import torch.distributed as dist

from trainer import expert_parallel
from trainer.distributed import (collective_device, dp_group, embedding_group, pp_size, pp_sum, tp_group,
                                 tp_rank_and_size)

_TP_PARTIAL = ("q_layernorm", "k_layernorm")


def reduce_gradients(named_params):
    """All-reduce (sum) the word embedding's grads over its pipeline copies, qk-layernorm grads over TP,
    a routed expert's grads over expert DP and every other grad over DP."""
    _sum_embedding_copies([p for _, p in named_params])
    _, tp = tp_rank_and_size()
    for name, p in named_params:
        if p.grad is None:
            continue
        if tp > 1 and any(k in name for k in _TP_PARTIAL):
            dist.all_reduce(p.grad, group=tp_group())
        group = expert_parallel.expert_dp_group() if expert_parallel.is_routed_expert(p) else dp_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)


def _sum_embedding_copies(params):
    """Under pipeline parallelism the first and last stage each hold the word embedding (the last for the MTP
    block or a tied output layer): both get the sum of their grads. A copy that got none counts zero; when
    neither got one, both keep none (the optimizer then skips them, as it skips the one-stage embedding)."""
    group = embedding_group() if pp_size() > 1 else None
    if group is None:
        return
    for p in params:
        if not getattr(p, "shared_embedding", False):
            continue
        has_grad = torch.tensor([float(p.grad is not None)], device=collective_device())
        dist.all_reduce(has_grad, group=group)
        if has_grad.item() == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)


def _counted_once(param, tp_rank):
    """Sharded params count on every rank; replicated ones only on TP rank 0; a pipeline stage's copy of
    another stage's weight (megatron's `shared`) nowhere."""
    if getattr(param, "shared", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def _sum_of_squares(params, group):
    """Sum of the squared grads of `params` (float64) over the ranks of `group`."""
    sq = torch.zeros((), dtype=torch.float64, device=collective_device())  # NCCL reduces CUDA tensors only
    for p in params:
        sq += p.grad.detach().double().pow(2).sum().to(sq.device)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    return sq.item()


def grad_norm(params):
    """L2 norm of the grads of `params` over the whole (TP-, ETP-, EP- and PP-sharded) model."""
    tp_rank, _ = tp_rank_and_size()
    with_grad = [p for p in params if p.grad is not None]
    experts = [p for p in with_grad if expert_parallel.is_routed_expert(p)]
    dense = [p for p in with_grad if not expert_parallel.is_routed_expert(p) and _counted_once(p, tp_rank)]
    sq = _sum_of_squares(dense, tp_group())
    if any(expert_parallel.is_routed_expert(p) for p in params):  # the same on every rank: the model's structure
        sq += _sum_of_squares(experts, expert_parallel.expert_shards_group())
    return math.sqrt(pp_sum(sq).item())  # each pipeline stage holds its own layers


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
