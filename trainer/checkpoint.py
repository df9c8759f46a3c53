"""torch_dist checkpoints (megatron `dist_checkpointing`): model, optimizer state, step.

The layout is TP-independent: a checkpoint saved at any TP size loads at any other
(megatron reshards). The AdamW moments are saved as sharded tensors that follow their
parameter's sharding (megatron's `optim_state_to_sharding_state`), so they reshard too.
`vime_meta.json` records the model config and MTP layer count for validation.
"""
import json
import os

import torch
import torch.distributed as dist

from vime.models.torch_dist_format import META_FILE, read_saved_meta


def _optimizer_params(optimizer):
    return [p for g in optimizer.param_groups for p in g["params"]]


def _init_adam_state(optimizer):
    for p in _optimizer_params(optimizer):
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _model_params_in_state_order(optimizer):
    """The model parameters in the order of the optimizer's state: its own parameters, or those a
    mixed-precision optimizer keeps fp32 copies of (`model_params`, trainer/mixed_precision.py)."""
    return getattr(optimizer, "model_params", None) or _optimizer_params(optimizer)


def _sharded_optimizer_state(optimizer, model_sharded):
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map, optim_state_to_sharding_state)

    state = optimizer.state_dict()
    id_map = get_param_id_to_sharded_param_map(model_sharded, _model_params_in_state_order(optimizer))
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    for param_state in state["state"].values():
        param_state.pop("step", None)  # saved once as the common step (all params share it)
    return state


def write_meta(path, meta):
    if dist.get_rank() == 0:
        with open(os.path.join(path, META_FILE), "w") as f:
            json.dump(meta, f, indent=2)


def read_meta(path, flag="--load"):
    return read_saved_meta(path, flag)


def _in_process_results_queue():
    # filesystem_async._get_write_results_queue starts a *spawn* multiprocessing Manager to
    # collect write results, which re-imports __main__ (breaks under pytest / without a
    # __main__ guard) and costs a process start per save. vime saves synchronously, so the
    # results are put and got in this process: a plain in-process queue is enough.
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _model_sharded_state(model):
    # a dict megatron fills with the data-parallel group: GPTModel.sharded_state_dict reads it for the
    # last pipeline stage's copy of the word embedding, and a None `metadata` there fails
    return model.sharded_state_dict(metadata={})


def save(path, model, optimizer=None, meta=None):
    """Save model (+ optimizer state and meta) to `path` on every rank of the group."""
    from megatron.core import dist_checkpointing

    _in_process_results_queue()
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    model_sharded = _model_sharded_state(model)
    state = {"model": model_sharded}
    step = 0
    if optimizer is not None:
        _init_adam_state(optimizer)
        step = int(next(iter(optimizer.state.values()))["step"].item()) if optimizer.state else 0
        state["optimizer"] = _sharded_optimizer_state(optimizer, model_sharded)
    dist_checkpointing.save(state, path)
    write_meta(path, dict(meta or {}, optimizer_step=step, has_optimizer=optimizer is not None))
    dist.barrier()


def load(path, model, optimizer=None):
    """Load weights (and optimizer state if the checkpoint has it) into model / optimizer."""
    from megatron.core import dist_checkpointing

    meta = read_meta(path)
    model_sharded = _model_sharded_state(model)
    state = {"model": model_sharded}
    with_optimizer = optimizer is not None and meta.get("has_optimizer")
    if with_optimizer:
        _init_adam_state(optimizer)
        state["optimizer"] = _sharded_optimizer_state(optimizer, model_sharded)
    loaded = dist_checkpointing.load(state, path)
    model.load_state_dict(loaded["model"])
    if with_optimizer:
        opt_state = loaded["optimizer"]
        for param_state in opt_state["state"].values():
            param_state["step"] = torch.tensor(float(meta["optimizer_step"]))
        optimizer.load_state_dict(opt_state)
    return meta
