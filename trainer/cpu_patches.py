"""The monkeypatches megatron-core 0.16.1 needs on CPU-only torch (the only place that has them).

`apply_cpu_patches()` is idempotent and does nothing when CUDA is available. Each patch
names the megatron-core call site that calls CUDA unconditionally.
"""
import warnings

import torch

_APPLIED = []

# Warnings megatron-core 0.16.1 (and torch's dist-checkpoint under it) prints in every
# trainer process of a normal CPU run; none asks the user to do anything: Apex and
# Transformer Engine are optional GPU kernels, vime sets no cuda-graph scope, passes no
# tp_group and uses megatron's own sharded checkpoints.
MEGATRON_NOISE = (
    r"Apex is not installed",
    r"Transformer Engine and Apex are not installed",
    r"full scope is deprecated",
    r".*tp_group is None, using default tp group",
    r"MLP requires ffn_hidden_size",
    r"The 'megatron\.core\.transformer\.custom_layers\.transformer_engine'",
    r"The following imports from `dynamic_context\.py`",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
    r"`load_state_dict` is deprecated",
    r"`torch\.jit\.script_method` is deprecated",
)


def quiet_megatron_warnings():
    """Ignore exactly the messages above (by text, so any new warning still shows)."""
    for message in MEGATRON_NOISE:
        warnings.filterwarnings("ignore", message=message)


def _patch_current_device():
    # torch.cuda.current_device() is used as a device argument throughout megatron-core:
    # RotaryEmbedding.get_emb (moves inv_freq), MTPLossLoggingHelper.save_loss_to_tracker,
    # dist_checkpointing state_dict_saver / async_utils.
    torch.cuda.current_device = lambda: "cpu"


def _patch_synchronize():
    # dist_checkpointing's torch_dist writer calls torch.cuda.synchronize() in preload_tensors.
    torch.cuda.synchronize = lambda *a, **k: None


def _patch_rng():
    # tensor_parallel.random: model_parallel_cuda_manual_seed and get_cuda_rng_tracker().fork()
    # (around attention dropout / MTP with sequence parallel) use CUDA generators.
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


PATCHES = {
    "torch.cuda.current_device -> 'cpu'": _patch_current_device,
    "torch.cuda.synchronize -> no-op": _patch_synchronize,
    "CUDA RNG tracker -> CPU generator": _patch_rng,
}


def apply_cpu_patches():
    """Apply every patch once when CUDA is absent; return the names applied so far."""
    if torch.cuda.is_available() or _APPLIED:
        return list(_APPLIED)
    for name, patch in PATCHES.items():
        patch()
        _APPLIED.append(name)
    return list(_APPLIED)
