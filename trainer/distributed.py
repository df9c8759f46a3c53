"""torch.distributed + megatron parallel_state setup and teardown for one trainer process.

`init_distributed` is what a Ray actor calls (it gets rank, world size and the master
address from the group that spawned it); `init_single_process` serves tests and tools.
Both are safe to call again in the same process (parallel_state is rebuilt, the previous layout's groups
destroyed).
"""
import contextlib
import gc
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.cpu_patches import apply_cpu_patches
from vime.errors import require
from vime.net import free_port
from vime.parallel_layout import ONE_RANK


# The process groups megatron's last `initialize_model_parallel` built. megatron's
# `destroy_model_parallel` forgets them without destroying them (its two gloo groups aside), and every
# gloo group keeps its threads until destroyed: a process that rebuilds its layout many times (a test
# session, a tool converting several checkpoints) would otherwise keep every layout's groups and threads.
_MEGATRON_GROUPS = []


def _live_groups():
    """Every process group torch.distributed holds (megatron reads the same registry)."""
    return list(dist.distributed_c10d._world.pg_map)


def destroy_megatron_groups():
    """Forget megatron's parallel state and destroy the process groups it built (not the default one)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if not _MEGATRON_GROUPS:
        return
    built, live = list(_MEGATRON_GROUPS), set(_live_groups())
    _MEGATRON_GROUPS.clear()
    for group in built:
        if group in live:  # the default group's destruction may have taken it already
            dist.destroy_process_group(group)
    built = live = group = None  # this frame's references go before the collector runs
    release_destroyed_groups()


def release_destroyed_groups():
    """Free what still holds destroyed groups. A gloo group ends its threads only when the object is freed, and
    megatron's modules and checkpoint strategies keep their groups in reference cycles that only the cycle
    collector frees: a model dropped before its groups were destroyed would keep them (and their threads)."""
    gc.collect()


def init_distributed(rank, world_size, master_addr, master_port, layout=ONE_RANK):
    """Join the process group (gloo on CPU, nccl on GPU) and build megatron's TP/PP/DP groups and its
    expert (EP x ETP) groups of `layout` (a vime.parallel_layout.ParallelLayout of `world_size` ranks)."""
    layout.check()
    layout.check_world(world_size)
    apply_cpu_patches()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                world_size=world_size, timeout=timedelta(minutes=10))
    from megatron.core import parallel_state as ps

    destroy_megatron_groups()
    groups_before = set(_live_groups())
    ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                                 context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
                                 expert_tensor_parallel_size=layout.etp)
    _MEGATRON_GROUPS.extend(group for group in _live_groups() if group not in groups_before)


def init_single_process():
    """A one-process group (reused if one already exists) for tests, tools and converters."""
    init_distributed(0, 1, "127.0.0.1", free_port())


def ensure_distributed(layout=ONE_RANK):
    """Reuse a multi-process group set up by the caller; otherwise (re)build a one-process one (then
    `layout` must be one rank's)."""
    from megatron.core import parallel_state as ps

    if dist.is_initialized() and dist.get_world_size() > 1:
        require(ps.model_parallel_is_initialized(), "call trainer.distributed.init_distributed first")
        return
    layout.check_world(1, "a lone trainer process")
    if (dist.is_initialized() and ps.model_parallel_is_initialized()
            and ps.get_tensor_model_parallel_world_size() == 1 and ps.get_pipeline_model_parallel_world_size() == 1):
        return
    init_single_process()


@contextlib.contextmanager
def owned_single_process():
    """A TP=1 one-process group for a tool; torn down after unless the caller already had one."""
    had_group = dist.is_initialized()
    init_single_process()
    try:
        yield
    finally:
        if not had_group:
            teardown()


def teardown():
    """Destroy megatron's groups and the process group."""
    destroy_megatron_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
        release_destroyed_groups()


def collective_device():
    """Where collective tensors must live: the current CUDA device under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def tp_rank_and_size():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def dp_group():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()


def dp_sum(value):
    """`value` summed over the data-parallel ranks, as a float64 tensor on the collective's device
    (NCCL reduces CUDA tensors only); callers read it with .item()."""
    t = torch.as_tensor(value, dtype=torch.float64).detach().clone().to(collective_device())
    if dist.get_world_size(dp_group()) > 1:
        dist.all_reduce(t, group=dp_group())
    return t


def routed_tokens_sum(value, sequence_parallel):
    """`value` summed over the ranks whose routers see different tokens: the data-parallel ranks, and under
    sequence parallelism the tensor-parallel ones too (each routes its part of the sequence)."""
    if not sequence_parallel:
        return dp_sum(value)
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_and_data_parallel_group()
    t = torch.as_tensor(value, dtype=torch.float64).detach().clone().to(collective_device())
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def pp_group():
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_group()


def pp_size():
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()


def last_stage_rank():
    """The global rank of this rank's pipeline-last stage (same TP and DP index)."""
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_last_rank()


def pp_sum(value):
    """`value` summed over this rank's pipeline stages (float64, on the collective's device)."""
    t = torch.as_tensor(value, dtype=torch.float64).detach().clone().to(collective_device())
    if pp_size() > 1:
        dist.all_reduce(t, group=pp_group())
    return t


def from_last_stage(obj):
    """The last pipeline stage's `obj` (any picklable value), on every stage of this rank's pipeline."""
    if pp_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=last_stage_rank(), group=pp_group(), device=collective_device())
    return box[0]


def tensor_from_last_stage(tensor):
    """The last pipeline stage's `tensor` on every stage of this rank's pipeline; the other stages pass
    a tensor of the same shape and dtype to receive into."""
    if pp_size() > 1:
        dist.broadcast(tensor, src=last_stage_rank(), group=pp_group())
    return tensor


def writes_for_last_stage():
    """Whether this rank writes what the last pipeline stage holds (its TP and DP index 0; trainer rank 0
    at one stage)."""
    from megatron.core import parallel_state as ps

    return (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0)
