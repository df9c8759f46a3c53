"""Expert parallelism (EP, and ETP inside each expert) in the trainer: which parameters are a rank's
share of the routed experts, their global expert ids, and the gathering of the shards into full
per-expert tensors.

megatron-core splits the routed experts of every MoE layer (the decoder's and the MTP layer's) over
the EP ranks of a pipeline stage: EP rank r holds experts r*n .. r*n+n-1 (n = experts / EP) as its
`local_experts.0 .. n-1`, and with ETP > 1 each expert's linears are tensor-parallel over the
expert-TP group. The routers are not split: every rank routes its own tokens over all experts, and
megatron's all-gather dispatcher brings each token to the ranks holding its experts (gathered over
ETP x EP, combined by reduce-scatter). Everything that enters or leaves the trainer names experts by
their global id: the HF tensors loaded at start and pushed to the engines, the torch_dist checkpoint
(megatron's sharded state dict maps local to global ids, so it reshards), the routes routing replay
takes. megatron's DDP reduces an expert shard's gradients over the expert-data-parallel ranks (the ranks
holding the same shard) and its optimizer's grad norm counts each shard once (trainer/optimizer.py).
"""
import itertools

import torch
import torch.distributed as dist

from vime.models.megatron_names import expert_index, with_expert_index


def _ps():
    from megatron.core import parallel_state as ps

    return ps


def is_expert_param(name):
    """True for a routed expert's parameter, by name (a rank's share under EP / ETP)."""
    return expert_index(name) is not None


def ep_rank_and_size():
    ps = _ps()
    return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()


def etp_rank_and_size():
    ps = _ps()
    return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()


def etp_group():
    return _ps().get_expert_tensor_parallel_group()


def expert_shards_group():
    """The ranks holding the other shards of the routed experts (ETP x EP): a grad norm sums over it."""
    return _ps().get_expert_tensor_and_model_parallel_group()


def exchanges_tokens():
    """Whether this rank's MoE layers exchange tokens with other ranks (ETP x EP > 1)."""
    return dist.get_world_size(expert_shards_group()) > 1


def padded_to_common_width(batch):
    """`batch` right-padded to the widest batch of the ranks it exchanges tokens with: megatron's
    all-gather dispatcher gathers equal-shaped [s * b, h] blocks from every rank of the ETP x EP group,
    so their micro-batches must have the same sequence length (their row counts already agree)."""
    from trainer.distributed import collective_device

    if not exchanges_tokens():
        return batch
    width = torch.tensor(batch.width, device=collective_device())
    dist.all_reduce(width, op=dist.ReduceOp.MAX, group=expert_shards_group())
    return batch.padded_to(int(width.item()))


def global_expert_name(name, num_local):
    """The parameter `name` of this rank's local expert, named by its global expert id."""
    prefix_and_index = expert_index(name)
    if prefix_and_index is None:
        return name
    ep_rank, _ = ep_rank_and_size()
    return with_expert_index(name, ep_rank * num_local + prefix_and_index[1])


def num_local_experts(model_cfg):
    _, ep = ep_rank_and_size()
    return model_cfg.moe.n_routed_experts // ep


def _experts_module(item):
    found = expert_index(item[0])
    return found[0] if found else None


def grouped_by_experts_module(named):
    """(experts module prefix or None, [(name, tensor)]) runs of `named`: each MoE layer's routed experts
    together (megatron lists them expert after expert), every other tensor alone."""
    for prefix, run in itertools.groupby(named, key=_experts_module):
        if prefix is None:
            for item in run:
                yield None, [item]
        else:
            yield prefix, list(run)


def gather_over_ep(named_full_local, num_local):
    """Every EP rank's experts of one MoE layer: `named_full_local` [(local name, tensor full over ETP)]
    in megatron's order; returns [(global name, tensor)] in global order, on every EP rank."""
    ep_rank, ep = ep_rank_and_size()
    if ep == 1:
        return [(global_expert_name(n, num_local), t) for n, t in named_full_local]
    group = _ps().get_expert_model_parallel_group()
    gathered = {}
    for name, local in named_full_local:
        parts = [torch.empty_like(local) for _ in range(ep)]
        dist.all_gather(parts, local.contiguous(), group=group)
        index = expert_index(name)[1]
        for r, part in enumerate(parts):
            gathered[(r * num_local + index, name)] = part
    order = {name: i for i, (name, _) in enumerate(named_full_local)}
    keys = sorted(gathered, key=lambda k: (k[0], order[k[1]]))
    return [(with_expert_index(name, expert), gathered[(expert, name)]) for expert, name in keys]

