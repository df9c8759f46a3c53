"""Moving weights between a TP-sharded megatron model and canonical HF tensors.

Sharding follows megatron's parameter attributes (`tensor_model_parallel`, `partition_dim`);
the one exception is `linear_fc1`, whose rows are [gate; up] on *every* rank, so each half
is split separately. Names go through vime/models/megatron_names.py. Besides the parameters, the
buffers that are checkpoint weights (the MoE router's expert bias) move too.
"""
import torch
import torch.distributed as dist

from vime.models.megatron_names import hf_to_megatron, is_synced_buffer, megatron_to_hf
from trainer.distributed import tp_group, tp_rank_and_size

_PER_HALF = ("mlp.linear_fc1.weight",)  # [gate; up] stacked within each TP shard


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


def gather(name, param):
    """The full megatron tensor of a (possibly TP-sharded) parameter, on every TP rank."""
    local = param.detach()
    _, tp = tp_rank_and_size()
    if not _is_sharded(param) or tp == 1:
        return local.clone()
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=tp_group())
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
    tp_rank, tp = tp_rank_and_size()
    for name, param in named_weight_tensors(model):
        full = hf_to_megatron(name, hf_state, model_cfg)
        param.copy_(shard(name, full, param, tp_rank, tp).to(param.dtype))


@torch.no_grad()
def named_hf_weights(model, model_cfg):
    """Yield (canonical HF name, full tensor) for every weight, trunk and MTP, gathered over TP."""
    for name, param in named_weight_tensors(model):
        yield from megatron_to_hf(name, gather(name, param), model_cfg)
