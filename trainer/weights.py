"""Moving weights between a TP-sharded megatron model and canonical HF tensors.

Sharding follows megatron's parameter attributes (`tensor_model_parallel`, `partition_dim`);
the one exception is `linear_fc1`, whose rows are [gate; up] on *every* rank, so each half
is split separately. Names go through vime/models/megatron_names.py. Besides the parameters, the
buffers that are checkpoint weights (the MoE router's expert bias) move too. A routed expert's
parameters are this rank's share under expert parallelism: sharded over the expert-TP group, named
by their global expert id and gathered over the EP ranks (trainer/expert_parallel.py).
"""
import torch
import torch.distributed as dist

from vime.models.megatron_names import hf_to_megatron, is_synced_buffer, megatron_to_hf
from trainer import expert_parallel
from trainer.distributed import tp_group, tp_rank_and_size

_PER_HALF = ("linear_fc1.weight",)  # [gate; up] stacked within each TP (or expert-TP) shard: every MLP, routed experts too


def _is_sharded(param):
    return bool(getattr(param, "tensor_model_parallel", False))


def _per_half(name):
    return name.endswith(_PER_HALF)


def shard(name, full, param, tp_rank, tp):
    """This rank's slice of a full megatron tensor."""
    if not _is_sharded(param) or tp == 1:
        return full
    dim = param.partition_dim
    if _per_half(name):
        return torch.cat([h.chunk(tp, dim=dim)[tp_rank] for h in full.chunk(2, dim=dim)], dim=dim)
    return full.chunk(tp, dim=dim)[tp_rank]


def _shard_group(name):
    """(rank, size, group) of the tensor-parallel group a parameter is sharded over: the expert-TP group
    for a routed expert's, the TP group for the others."""
    if expert_parallel.is_expert_param(name):
        return (*expert_parallel.etp_rank_and_size(), expert_parallel.etp_group())
    return (*tp_rank_and_size(), tp_group())


def gather(name, param):
    """The full megatron tensor of a (possibly TP- or ETP-sharded) parameter, on every rank of its group."""
    local = param.detach()
    _, tp, group = _shard_group(name)
    if not _is_sharded(param) or tp == 1:
        return local.clone()
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    dim = param.partition_dim
    if _per_half(name):
        halves = [p.chunk(2, dim=dim) for p in parts]
        return torch.cat([torch.cat([h[i] for h in halves], dim=dim) for i in range(2)], dim=dim)
    return torch.cat(parts, dim=dim)


def named_weight_tensors(model):
    """(megatron name, tensor) of every parameter and every buffer that is a checkpoint weight."""
    yield from model.named_parameters()
    yield from ((n, b) for n, b in model.named_buffers() if is_synced_buffer(n))


@torch.no_grad()
def load_hf_state(model, hf_state, model_cfg):
    """Copy canonical HF tensors into every weight of `model` (this rank's shards)."""
    num_local = expert_parallel.num_local_experts(model_cfg) if model_cfg.moe is not None else 0
    for name, param in named_weight_tensors(model):
        full = hf_to_megatron(expert_parallel.global_expert_name(name, num_local), hf_state, model_cfg)
        rank, size, _ = _shard_group(name)
        param.copy_(shard(name, full, param, rank, size).to(param.dtype))


def named_full_weights(model, model_cfg):
    """(megatron name, full tensor) of every weight on every rank: TP and ETP shards gathered, and each
    MoE layer's routed experts gathered over the EP ranks, named by their global expert ids."""
    num_local = expert_parallel.num_local_experts(model_cfg) if model_cfg.moe is not None else 0
    for experts, named in expert_parallel.grouped_by_experts_module(named_weight_tensors(model)):
        full = [(name, gather(name, param)) for name, param in named]
        yield from expert_parallel.gather_over_ep(full, num_local) if experts else full


@torch.no_grad()
def named_hf_weights(model, model_cfg):
    """Yield (canonical HF name, full tensor) for every weight, trunk and MTP, gathered over TP and EP."""
    for name, tensor in named_full_weights(model, model_cfg):
        yield from megatron_to_hf(name, tensor, model_cfg)
