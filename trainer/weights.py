"""Moving weights between a sharded megatron model and canonical HF tensors (loading, pushing).

A rank holds a part of the model: the layers of its pipeline stage, and of each of their tensors its
TP shard. A push delivers the whole model, so the rank that sends it (trainer rank 0) gathers it in
two steps, one per kind of split:

- `STAGE_GATHERS`, one gather per parallel dimension that splits a pipeline stage's weights, in order,
  each taking and yielding (megatron name, tensor) pairs of the stage: `tp` all-gathers each tensor's
  shards (a routed expert's over its expert-TP group), `ep` each MoE layer's experts over the EP ranks;
  then every rank of the stage holds its full tensors. `stage_hf_weights` runs them and maps the names
  to HF (vime/models/megatron_names.py).
- `gather_stages`: the stages' HF-named tensors (and the draft's, which lives on the last stage) sent
  point to point to the first stage of trainer rank 0's pipeline, which then holds the whole model and
  pushes it. (Each stage could instead push its own layers to the engines, as slime does: one hop less
  for those layers; `scripts/bench/weight_sync.py stages` measures both, docs/at_scale.md says why vime
  gathers.)

Sharding follows megatron's parameter attributes (`tensor_model_parallel`, `partition_dim`);
the one exception is `linear_fc1`, whose rows are [gate; up] on *every* rank, so each half
is split separately. Besides the parameters, the buffers that are checkpoint weights (the MoE
router's expert bias) move too. A routed expert's parameters are this rank's share under expert
parallelism: sharded over the expert-TP group, named by their global expert id and gathered over
the EP ranks (trainer/expert_parallel.py).
"""
import math

import torch
import torch.distributed as dist

from vime import weight_sync
from vime.models.megatron_names import hf_to_megatron, megatron_to_hf
from trainer import expert_parallel
from trainer.distributed import (collective_device, dp_group, pp_group, pp_size, tp_group,
                                 tp_rank_and_size)
from trainer.model import (WORD_EMBEDDING, is_last_stage, last_stage_keeps_word_embedding, named_weights)

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


@torch.no_grad()
def load_hf_state(model, hf_state, model_cfg):
    """Copy canonical HF tensors into every weight of `model` (this rank's shards of this stage's weights,
    the stage's copies of the word embedding too)."""
    num_local = _num_local_experts(model_cfg)
    for name, param in named_weights(model, copies=True):
        full = hf_to_megatron(expert_parallel.global_expert_name(name, num_local), hf_state, model_cfg)
        rank, size, _ = _shard_group(name)
        param.copy_(shard(name, full, param, rank, size).to(param.dtype))


def _num_local_experts(model_cfg):
    return expert_parallel.num_local_experts(model_cfg) if model_cfg.moe is not None else 0


@torch.no_grad()
def word_embedding_on_last_stage(model):
    """Collective over the pipeline stages: the whole word embedding (gathered over TP), detached, on the
    last stage: its own copy, or sent by the first stage when it keeps none; None on the others."""
    ranks = dist.get_process_group_ranks(pp_group())
    if len(ranks) == 1 or (last_stage_keeps_word_embedding(model) and is_last_stage(model)):
        return gather(WORD_EMBEDDING, model.shared_embedding_or_output_weight())
    if last_stage_keeps_word_embedding(model):
        return None
    if model.pre_process:
        dist.send(gather(WORD_EMBEDDING, model.embedding.word_embeddings.weight).to(collective_device()),
                  dst=ranks[-1], group=pp_group())
    if not is_last_stage(model):
        return None
    weight = model.output_layer.weight  # [V / TP, H]: the embedding's shape and dtype
    tp = tp_rank_and_size()[1]
    embedding = torch.empty(weight.shape[0] * tp, weight.shape[1], dtype=weight.dtype, device=collective_device())
    dist.recv(embedding, src=ranks[0], group=pp_group())
    return embedding


def _gather_tensor_parallel(named, model_cfg):
    """Every TP rank: the full tensor of each (megatron name, shard) of the stage (a routed expert's over
    its expert-TP group)."""
    for name, param in named:
        yield name, gather(name, param)


def _gather_experts(named, model_cfg):
    """Every EP rank: each MoE layer's routed experts of all EP ranks, named by their global expert ids."""
    num_local = _num_local_experts(model_cfg)
    for experts, run in expert_parallel.grouped_by_experts_module(named):
        yield from expert_parallel.gather_over_ep(run, num_local) if experts else run


# parallel dimension -> its gather within a stage, in order: each takes and yields (megatron name, tensor)
STAGE_GATHERS = {"tp": _gather_tensor_parallel, "ep": _gather_experts}


@torch.no_grad()
def stage_hf_weights(model, model_cfg):
    """[(canonical HF name, full tensor)] of every weight of this pipeline stage (trunk and MTP), gathered
    over the dimensions that split a stage (`STAGE_GATHERS`); the same on every rank of the stage."""
    named = named_weights(model)
    for gather_dimension in STAGE_GATHERS.values():
        named = gather_dimension(named, model_cfg)
    return [hf for name, tensor in named for hf in megatron_to_hf(name, tensor, model_cfg)]


def _gathers_stages():
    """Whether this rank's pipeline gathers its stages: trainer rank 0's (TP and DP index 0), the pusher's."""
    tp_rank, _ = tp_rank_and_size()
    return tp_rank == 0 and dist.get_rank(dp_group()) == 0


@torch.no_grad()
def gather_stages(named):
    """Collective over the pipeline stages. Every stage's (name, tensor) pairs, in stage order, on the first
    stage of trainer rank 0's pipeline; [] on the other stages of that pipeline; each rank's own pairs
    elsewhere (nobody pushes from there). One stage: `named` as it is."""
    named = list(named)
    if pp_size() == 1 or not _gathers_stages():
        return named
    group = pp_group()
    ranks = dist.get_process_group_ranks(group)
    stage = ranks.index(dist.get_rank())
    if stage > 0:
        _send_pairs(named, ranks[0], group)
        return []
    for src in ranks[1:]:
        named += _recv_pairs(src, group)
    return named


def _send_pairs(named, dst, group):
    """The pairs in the weight-sync wire format: the bucket layout (names, shapes, dtypes), then each bucket flat
    (one per run of a dtype)."""
    layout = weight_sync.bucket_layout(named, buffer_size=math.inf)
    dist.send_object_list([layout], dst=dst, group=group, device=collective_device())
    by_name = dict(named)
    for bucket in layout:
        dist.send(weight_sync.flatten_bucket(bucket, by_name).to(collective_device()), dst=dst, group=group)


def _recv_pairs(src, group):
    box = [None]
    dist.recv_object_list(box, src=src, group=group, device=collective_device())
    pairs = []
    for bucket in box[0]:
        flat = torch.empty(sum(s.numel for s in bucket), dtype=bucket[0].dtype, device=collective_device())
        dist.recv(flat, src=src, group=group)
        pairs += weight_sync.unflatten_bucket(bucket, flat)
    return pairs
