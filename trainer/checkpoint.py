"""torch_dist checkpoints (megatron `dist_checkpointing`): the model's weights and its optimizers' state.

The format is layout-independent: megatron reshards every tensor on load, so a checkpoint saved at any
TP / PP / EP / DP loads at any other. The optimizers' state is megatron's own sharded state dict
(`MegatronOptimizer.sharded_state_dict`, the distributed optimizer's gathered by parameter: megatron's
`fully_reshardable`; its model-space format is unusable in megatron-core 0.16): every
Adam moment is saved under its parameter's key (`optimizer.state.exp_avg.<key>` ...), sharded as the
parameter is, so it reshards too: a checkpoint resumes in any layout and either optimizer. A resumed
optimizer takes the saved tensors and the step count (`vime_meta.json`); its settings (learning rate,
weight decay, its own layout of the state) are the resumed run's. Under --bf16
the weights are saved in bf16 and their fp32 masters beside the moments (`optimizer.state.fp32_param.<key>`, the
distributed optimizer's `optimizer.state.param.<key>`, either read as the other):
loading weights takes the masters wherever the checkpoint has them (a --bf16 checkpoint resumes in fp32 or
converts to HF without rounding), and an optimizer that keeps masters takes an fp32 checkpoint's weights as
its masters. `vime_meta.json` records the model config and the MTP layer count for validation.
"""
import json
import os

import torch.distributed as dist

from vime.models.torch_dist_format import META_FILE, read_saved_meta

# megatron's key prefixes of the fp32 main weights in an optimizer's state: the plain optimizers' and the
# distributed optimizer's (its fully_reshardable format), the same tensors by either name
MASTERS = ("optimizer.state.fp32_param.", "optimizer.state.param.")
# megatron's metadata of the optimizer's sharded state: the distributed optimizer's gathered by parameter (keys
# as the non-distributed optimizer's) over gloo (its other gather needs CUDA), and no per-optimizer key prefix
OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable",
                    "distrib_optim_fully_reshardable_mem_efficient": True, "chained_optim_avoid_prefix": True}


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


def _optimizer_state(optimizers, model_sharded, is_loading=False):
    return {name: optimizer.sharded_state_dict(model_sharded, is_loading=is_loading, metadata=OPTIMIZER_FORMAT)
            for name, optimizer in optimizers.items()}


def optimizer_step(optimizer):
    """The steps a megatron optimizer has taken: its inner torch optimizers' step count (0 before the first)."""
    from trainer.offload import inner_optimizers

    steps = [float(state["step"]) for inner in inner_optimizers(optimizer) for state in inner.state.values()
             if "step" in state]
    return int(max(steps, default=0))


def _set_step(optimizer, step):
    """Every parameter state of a megatron optimizer's inner torch optimizers at step `step` (Adam's bias
    correction reads it)."""
    import torch

    from trainer.offload import inner_optimizers

    for inner in inner_optimizers(optimizer):
        for state in inner.state.values():
            state["step"] = torch.tensor(float(step), dtype=torch.float32)


def _init_state(optimizer):
    """Adam's zero moments at step 0 for every parameter of a megatron optimizer that has not stepped yet, as the
    first step would make them, so that a checkpoint saved before it holds the tensors of any other (torch's Adam
    in megatron's optimizers and in its HybridDeviceOptimizer; Transformer Engine's by megatron's init_state_fn)."""
    import torch

    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = megatron_optimizer.optimizer
        if inner is None:
            continue
        for torch_optimizer in getattr(inner, "sub_optimizers", [inner]):
            if not isinstance(torch_optimizer, torch.optim.Adam):  # AdamW is one
                megatron_optimizer.init_state_fn(torch_optimizer, megatron_optimizer.config)
                continue
            for group in torch_optimizer.param_groups:
                for p in group["params"]:
                    if not torch_optimizer.state[p]:
                        torch_optimizer.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                                                        step=torch.zeros((), dtype=torch.float32))
        if hasattr(inner, "sub_optimizers"):  # the HybridDeviceOptimizer's own view of its sub-optimizers' state
            inner._sync_sub_optimizers_state_to_hdo()


def save(path, model, optimizers=None, meta=None):
    """Save `model` and the state of `optimizers` ({name: megatron optimizer}, or None) to `path`, with `meta`
    (collective: every rank of the group calls it)."""
    from megatron.core import dist_checkpointing

    _in_process_results_queue()
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    model_sharded = _model_sharded_state(model)
    state = {"model": model_sharded}
    if optimizers:
        for optimizer in optimizers.values():
            _init_state(optimizer)
        state["optimizer"] = _optimizer_state(optimizers, model_sharded)
    dist_checkpointing.save(state, path)
    steps = {name: optimizer_step(optimizer) for name, optimizer in (optimizers or {}).items()}
    write_meta(path, dict(meta or {}, has_optimizer=bool(optimizers), optimizer_steps=steps))
    dist.barrier()


def _saved_keys(path):
    from megatron.core import dist_checkpointing

    return set(dist_checkpointing.load_tensors_metadata(path))


def _each_sharded_tensor(state):
    """Every sharded tensor of `state`, megatron's factories of several (the split halves of a SwiGLU
    weight) included: each has the key the checkpoint names it by."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    stack = [state]
    while stack:
        node = stack.pop()
        values = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for value in values:
            if isinstance(value, (ShardedTensor, ShardedTensorFactory)):
                yield value
            elif isinstance(value, (dict, list)):
                stack.append(value)


def _with_loaded_tensors(fresh, loaded):
    """`fresh` (an optimizer's sharded state dict built now) with each of its sharded entries replaced by what
    the load put at the same place in `loaded`; every other value stays the running optimizer's (megatron's
    nonpersistent ones unwrapped, as its load unwraps them)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    if isinstance(fresh, ShardedBase):
        return loaded
    if isinstance(fresh, LocalNonpersistentObject):
        return fresh.unwrap()
    if isinstance(fresh, dict):
        return {k: _with_loaded_tensors(v, loaded[k] if _holds_sharded(v) else None) for k, v in fresh.items()}
    if isinstance(fresh, list):
        return [_with_loaded_tensors(v, loaded[i] if _holds_sharded(v) else None) for i, v in enumerate(fresh)]
    return fresh


def _with_step(state, step):
    """`state` with the step count in every parameter's state (torch's Adam takes none without it)."""
    import torch

    if isinstance(state, dict):
        state = {k: _with_step(v, step) for k, v in state.items()}
        if "exp_avg" in state:
            state["step"] = torch.tensor(float(step), dtype=torch.float32)
    elif isinstance(state, list):
        state = [_with_step(v, step) for v in state]
    return state


def _holds_sharded(node):
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if isinstance(node, ShardedBase):
        return True
    values = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    return any(_holds_sharded(v) for v in values)


def _weights_of_masters(key):
    return next((key[len(prefix):] for prefix in MASTERS if key.startswith(prefix)), None)


def _saved_masters(weights, saved):
    """The key the checkpoint (its keys `saved`) holds the fp32 masters of `weights` under, or None."""
    return next((prefix + weights for prefix in MASTERS if _in(prefix + weights, saved)), None)


def _in(key, saved):
    """Whether the checkpoint (its keys `saved`) holds the tensor saved under `key` (a factory's under its
    parts' keys: megatron's SwiGLU weight as `<key>_w` and `<key>_v` when TP splits it)."""
    return key in saved or f"{key}_w" in saved


def load(path, model, optimizers=None):
    """Load the weights of `path` into `model` and, when it holds optimizer state, the state of `optimizers`
    ({name: megatron optimizer}, the names `save` was given); their main weights follow the loaded weights
    when they take no state. Returns the checkpoint's meta."""
    from megatron.core import dist_checkpointing

    meta = read_meta(path)
    saved = _saved_keys(path)
    model_sharded = _model_sharded_state(model)
    state = {"model": model_sharded}
    with_optimizer = bool(optimizers) and meta.get("has_optimizer")
    if with_optimizer:
        for optimizer in optimizers.values():  # the distributed optimizer's state dict needs a step to read
            _init_state(optimizer)
        state["optimizer"] = _optimizer_state(optimizers, model_sharded, is_loading=True)
        # masters this optimizer keeps under the other name, or not at all: an fp32 run's weights are its masters
        for tensor in _each_sharded_tensor(state["optimizer"]):
            weights = _weights_of_masters(tensor.key)
            if weights is not None and not _in(tensor.key, saved):
                tensor.key = _saved_masters(weights, saved) or (weights if _in(weights, saved) else tensor.key)
    requested = {t.key for t in _each_sharded_tensor(state.get("optimizer", {}))}
    for tensor in _each_sharded_tensor(model_sharded):  # the fp32 masters where no optimizer takes them
        masters = _saved_masters(tensor.key, saved)
        if masters is not None and masters not in requested:
            tensor.key = masters
    if requested & {t.key for t in _each_sharded_tensor(model_sharded)}:
        # the optimizer reads masters from the weights the model reads: one load each (torch's checkpoint reader
        # refuses one key requested twice on a rank, overlapping itself)
        loaded = {**dist_checkpointing.load({"model": model_sharded}, path),
                  **dist_checkpointing.load({"optimizer": state["optimizer"]}, path)}
    else:
        loaded = dist_checkpointing.load(state, path)
    model.load_state_dict(loaded["model"])
    for name, optimizer in (optimizers or {}).items():
        if with_optimizer:
            step = meta.get("optimizer_steps", {}).get(name, meta.get("optimizer_step", 0))
            fresh = optimizer.sharded_state_dict(_model_sharded_state(model), is_loading=True, metadata=OPTIMIZER_FORMAT)
            optimizer.load_state_dict(_with_step(_with_loaded_tensors(fresh, loaded["optimizer"][name]), step))
            _set_step(optimizer, step)
        else:
            optimizer.reload_model_params()
    return meta
