"""The monkeypatches and module fixes megatron-core 0.16.1 needs (the only place that has them).

`apply_cpu_patches()` is idempotent. On CPU-only torch it applies `PATCHES`, each naming the
megatron-core call site that calls CUDA unconditionally; everywhere it applies `MODEL_PATCHES`,
where megatron-core's model code differs from the checkpoints' reference (DeepSeek-V3's routing)
or fails without Transformer Engine. `latent_core_attention()` is the core attention the local
(non-Transformer-Engine) multi-latent-attention layer needs.
"""
import contextlib
import functools
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
    # the all-gather token dispatcher's collectives at EP / ETP > 1 (and TP's gathers): gloo implements
    # both in torch 2.13, so they need no CPU stand-in; torch only renames them
    r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
    r"`torch\.distributed\.reduce_scatter_tensor` is deprecated",
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


def _on_cpu(device):
    return "cpu" if device == "cuda" else device


class _TorchOnCpu:
    """The torch module as one megatron module sees it, with tensors it asks to create on "cuda" made on
    the CPU (everything else is torch's own)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*size, device=None, **kwargs):
        return torch.zeros(*size, device=_on_cpu(device), **kwargs)

    @staticmethod
    def tensor(data, device=None, **kwargs):
        return torch.tensor(data, device=_on_cpu(device), **kwargs)


def _patch_schedule_token_count():
    # pipeline_parallel.schedules: forward_backward_no_pipelining and
    # forward_backward_pipelining_without_interleaving count the step's tokens in
    # torch.zeros([], dtype=torch.int, device="cuda").
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchOnCpu()


def _patch_optimizer_tensors_on_cuda():
    # optimizer.MixedPrecisionOptimizer.__init__ / FP32Optimizer.__init__ (found_inf, the dummy overflow buffer,
    # the unit loss scale) and clip_grads.get_grad_norm_fp32 / clip_grad_by_total_norm_fp32 / count_zeros_fp32
    # (the norm's accumulators), and utils.local_multi_tensor_l2_norm (the grad norm without Apex) make their
    # scalars with device='cuda'.
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    optimizer.torch = clip_grads.torch = utils.torch = _TorchOnCpu()


@contextlib.contextmanager
def _tensors_named_as_cuda():
    """Within: a tensor's `type()` names its CUDA type (torch.cuda.FloatTensor ...) on the CPU too."""
    cpu_type = torch.Tensor.type

    def type_as_cuda(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is not None:
            return cpu_type(self, dtype, non_blocking, **kwargs)
        name = cpu_type(self)
        return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_as_cuda
    try:
        yield
    finally:
        torch.Tensor.type = cpu_type


def _named_as_cuda(function):
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        with _tensors_named_as_cuda():
            return function(*args, **kwargs)
    return wrapped


def _patch_optimizer_type_checks():
    # megatron's optimizers sort parameters by their type string and accept only CUDA ones:
    # Float16OptimizerWithFloat16Params.__init__ and DistributedOptimizer.__init__ (with its
    # _build_model_and_main_param_groups) by `param.type() in ['torch.cuda.HalfTensor', ...]`, and
    # clip_grads.clip_grad_by_total_norm_fp32 asserts `grad.type() == 'torch.cuda.FloatTensor'`
    # (called from optimizer.MegatronOptimizer.clip_grad_norm and ChainedOptimizer.step).
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    for cls in (optimizer.Float16OptimizerWithFloat16Params, distrib_optimizer.DistributedOptimizer):
        cls.__init__ = _named_as_cuda(cls.__init__)
    clip = _named_as_cuda(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = optimizer.clip_grad_by_total_norm_fp32 = clip


class _HostStream:
    """A CUDA stream's and event's interface, doing nothing: on the CPU every copy is done when it returns."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def record_event(self, *args):
        return self

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass


class _CudaStreamsOnHost:
    """torch.cuda as hybrid_optimizer sees it on the CPU: streams that do nothing, the rest torch's."""

    Stream = _HostStream

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_stream(*args):
        return _HostStream()

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()


class _TorchWithHostStreams:
    cuda = _CudaStreamsOnHost()

    def __getattr__(self, name):
        return getattr(torch, name)


def _host_hybrid_optimizer():
    """megatron's HybridDeviceOptimizer on a machine whose device is the host (see `_patch_hybrid_optimizer`)."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    class HostHybridDeviceOptimizer(HybridDeviceOptimizer):
        """HybridDeviceOptimizer splitting the trainer's parameters as it splits a GPU's: the first
        `offload_fraction` of their elements stepped by host optimizers on copies (gradients copied to the
        copies before, the updated copies copied back after), the rest by the device optimizer in place, fp32
        main copies of bf16 parameters either way. Its own split asks `param.is_cuda`, false for every
        parameter of a CPU trainer; here the device is the host and a parameter is on it when it is a trainer
        parameter (not one of the optimizer's own copies)."""

        def _get_sub_optimizer_param_groups(self, offload_fraction):
            params = [p for group in self.param_groups for p in group["params"]]
            offload_threshold = sum(p.numel() for p in params) * offload_fraction
            offloaded, cpu_groups, device_groups = 0, [], []
            to_copy, copy_of, fp32_of = {}, {}, {}
            for group in self.param_groups:
                device_group, cpu_group = dict(group, params=[]), dict(group, params=[])
                for param in group["params"]:
                    inner, on_host = param, offloaded < offload_threshold
                    if on_host:  # the host optimizer's own copy, as megatron's pinned .cpu() copy
                        inner = param.detach().clone()
                        offloaded += param.numel()
                    if self.param_update_in_fp32 and inner.dtype != torch.float32:
                        inner = inner.detach().clone().float()
                        fp32_of[param] = inner
                    if on_host:
                        to_copy[param], copy_of[inner] = inner, param
                    (cpu_group if on_host else device_group)["params"].append(inner)
                for kept, groups in ((device_group, device_groups), (cpu_group, cpu_groups)):
                    if kept["params"]:
                        groups.append(kept)
            return cpu_groups, device_groups, to_copy, copy_of, fp32_of

    return HostHybridDeviceOptimizer


def _patch_hybrid_optimizer():
    # optimizer_cpu_offload: HybridDeviceOptimizer (cpu_offloading/hybrid_optimizer.py) overlaps its copies on
    # torch.cuda streams and events (_init_sub_optimizers, step, the copy-back hook) and splits the parameters by
    # param.is_cuda (_get_sub_optimizer_param_groups); get_megatron_optimizer (optimizer/__init__.py) and
    # DistributedOptimizer.__init__ (distrib_optimizer.py) build it by name. On the CPU the streams do nothing
    # and the split is the host stand-in's, the same split of the same parameters.
    from megatron.core import optimizer
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    hybrid_optimizer.torch = _TorchWithHostStreams()
    optimizer.HybridDeviceOptimizer = distrib_optimizer.HybridDeviceOptimizer = _host_hybrid_optimizer()


def _patch_embedding_copy_to_cuda():
    # LanguageModule.setup_embeddings_and_output_layer: under pipeline parallelism the last stage's copy
    # of the word embedding is moved to CUDA (`weight.data = weight.data.cuda()`) before it is all-reduced
    # with the first stage's; on CPU it stays where it is.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = LanguageModule.setup_embeddings_and_output_layer

    def setup_on_cpu(self):
        to_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
        try:
            setup(self)
        finally:
            torch.Tensor.cuda = to_cuda

    LanguageModule.setup_embeddings_and_output_layer = setup_on_cpu


def _disable_dynamo():
    # megatron.core.jit.jit_fuser is torch.compile, bound when `import megatron.core` imports the
    # MoE router and experts: on CPU their first step would spend seconds compiling C++ kernels.
    import torch._dynamo as dynamo

    dynamo.config.disable = True


def _patch_te_general_gemm():
    # moe_utils names te_general_gemm only when Transformer Engine imports; the router's gating
    # linear reads it regardless (NameError without TE).
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_mla_without_te():
    # multi_latent_attention imports megatron.core.extensions.transformer_engine, which without
    # Transformer Engine succeeds with mock classes; MLASelfAttention.__init__ then calls
    # isinstance(linear_proj, <mock TELinear>) and fails. Its own no-TE branch is the right one.
    import importlib.util

    import megatron.core.transformer.multi_latent_attention as mla

    if importlib.util.find_spec("transformer_engine") is None:
        mla.HAVE_TE = False


def _group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk):
    """megatron's group_limited_topk with the checkpoints' group rank (vime.models.moe_routing)."""
    from vime.models.moe_routing import group_limited_mask

    allowed = group_limited_mask(scores, num_groups, group_topk)
    return scores.masked_fill(~allowed, float("-inf")).topk(topk, dim=-1)


def _patch_group_limited_topk():
    # moe_utils.topk_routing_with_score_function ranks an expert group by the sum of its top
    # (topk / group_topk) scores; DeepSeek-V3 and GLM-4.5 (and their engines) rank it by its top 2,
    # which agree only when topk = 2 * group_topk (DeepSeek-V3's 8 and 4).
    import megatron.core.transformer.moe.moe_utils as moe_utils

    moe_utils.group_limited_topk = _group_limited_topk


def _count_expert_load(self, routing_map, padding_mask=None):
    """TopKRouter._apply_expert_bias counting once per training forward, only the tokens in the router's
    `counted_tokens` ([s * b] bool, or None for all), both set by trainer.model.counting_tokens."""
    # megatron counts when grad is enabled, which under activation recompute is the recompute in the backward pass,
    # outside the forward's token mask; vime counts in the forward itself (a recompute's first run is under no_grad)
    if not (self.enable_expert_bias and self.counting):
        return
    counted = self.counted_tokens
    with torch.no_grad():
        if counted is not None:
            assert counted.shape[0] == routing_map.shape[0], (counted.shape, routing_map.shape)
            routing_map = routing_map & counted[:, None]
        self.local_tokens_per_expert += routing_map.sum(dim=0)


def _patch_expert_load_count():
    # the expert-bias step must see only real tokens; TopKRouter's own padding_mask route fails:
    # `routing_map & ~padding_mask` pairs a [tokens, experts] map with a [tokens] mask (no broadcast)
    from megatron.core.transformer.moe.router import TopKRouter

    TopKRouter.counted_tokens = None
    TopKRouter.counting = False
    TopKRouter._apply_expert_bias = _count_expert_load


def _patch_te_version_without_te():
    # optimizer_config.OptimizerConfig.__post_init__ asks is_te_min_version("2.1.0") for the precision-aware
    # optimizer (whether TE's FusedAdam can store parameter remainders), and megatron's utils.get_te_version
    # is None without Transformer Engine, so the comparison raises: without TE, no version is new enough.
    import importlib.util

    from megatron.core.optimizer import optimizer_config

    if importlib.util.find_spec("transformer_engine") is None:
        optimizer_config.is_te_min_version = lambda *args, **kwargs: False


def _sequence_parallel_norm(config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                            normalization="LayerNorm"):
    """torch's norm of `config.normalization` on a sequence-parallel rank's part of the sequence, its weight
    marked `sequence_parallel` as Transformer Engine's and Apex's norms mark theirs (megatron's
    finalize_model_grads then sums its gradient, a partial sum over this rank's positions, over TP)."""
    norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
    norm = norms[config.normalization](hidden_size, eps=eps)
    for param in norm.parameters():
        param.sequence_parallel = True
    return norm


def _patch_torch_norm_sequence_parallel():
    # transformer/torch_norm.py WrappedTorchNorm.__new__ (the norm of the local spec, gpt_layer_specs' LNImpl
    # without Apex) asserts `not config.sequence_parallel`: torch's norms do not mark their weights for the
    # sum over TP that sequence parallelism needs. Under sequence parallelism the stand-in marks them.
    from megatron.core.transformer import torch_norm

    wrapped = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, *args, **kwargs):
        return (_sequence_parallel_norm(config, *args, **kwargs) if config.sequence_parallel
                else wrapped(cls, config, *args, **kwargs))

    torch_norm.WrappedTorchNorm.__new__ = new


def _patch_reshardable_load_keeps_step():
    # DistributedOptimizer.load_parameter_state_from_fully_reshardable (distrib_optimizer.py) leaves torch Adam's
    # "step" out of each parameter's loaded tensors (load_state_dict has just set it from the param groups), then
    # _set_main_param_and_optimizer_states copies every key of the parameter's state, "step" included: KeyError
    # whenever the inner optimizer is torch's (no Transformer Engine or Apex). The step stays the one set.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states_keeping_step(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        set_states(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_keeping_step


def _allow_hybrid_optimizer_classes_in_checkpoints():
    # HybridDeviceOptimizer keeps its sub-optimizers' classes in its param groups (cpu_optimizer_cls,
    # gpu_optimizer_cls), so a checkpoint of it pickles them into common.pt; megatron reads common.pt with torch's
    # weights-only loader, whose allowed globals (megatron.core.safe_globals) do not name them.
    torch.serialization.add_safe_globals([torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])


def _mark_latent_kv(rope_width, module, args, output):
    output[0].vime_rope_key_width = rope_width  # the columns of it whose gradient gather_latent_kv sums


def _patch_mla_rope_key_gradient():
    # Without Transformer Engine MLASelfAttention's down projections are ColumnParallelLinear
    # (get_query_key_value_tensors): it all-gathers [kv latent | rope key] over TP and splits the rope key off.
    # That key is shared by every head, and each TP rank's heads give it a part of its gradient, which the
    # gather's backward (a split) never sums; Transformer Engine's duplicated projection sums it in its
    # sequence gather. Here the rope key's gradient is all-reduced over TP before the split.
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer import multi_latent_attention as mla

    gather = mla.gather_from_tensor_model_parallel_region

    def gather_latent_kv(input_, *args, **kwargs):
        output = gather(input_, *args, **kwargs)
        rope_width = getattr(input_, "vime_rope_key_width", None)
        if rope_width is None:
            return output
        latent, rope_key = output.split([output.shape[-1] - rope_width, rope_width], dim=-1)
        return torch.cat([latent, _SumOverTensorParallel.apply(rope_key)], dim=-1)

    init = mla.MLASelfAttention.__init__

    def init_marking_latent_kv(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if isinstance(self.linear_kv_down_proj, ColumnParallelLinear):
            self.linear_kv_down_proj.register_forward_hook(
                functools.partial(_mark_latent_kv, self.config.qk_pos_emb_head_dim))

    mla.gather_from_tensor_model_parallel_region = gather_latent_kv
    mla.MLASelfAttention.__init__ = init_marking_latent_kv


class _SumOverTensorParallel(torch.autograd.Function):
    """Identity forward; the gradient all-reduced over TP (megatron's copy_to_tensor_model_parallel_region
    all-reduces a contiguous copy of a strided gradient and returns the gradient unreduced)."""

    @staticmethod
    def forward(ctx, input_):
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad):
        from megatron.core import parallel_state

        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        return grad


PATCHES = {
    "torch.cuda.current_device -> 'cpu'": _patch_current_device,
    "torch.cuda.synchronize -> no-op": _patch_synchronize,
    "CUDA RNG tracker -> CPU generator": _patch_rng,
    "torch._dynamo disabled (megatron's jit_fuser would compile MoE kernels)": _disable_dynamo,
    "pipeline schedules count tokens on the CPU": _patch_schedule_token_count,
    "the last stage's word-embedding copy stays on the CPU": _patch_embedding_copy_to_cuda,
    "the optimizers' scalars on the CPU": _patch_optimizer_tensors_on_cuda,
    "the optimizers take CPU parameters (their type checks)": _patch_optimizer_type_checks,
    "HybridDeviceOptimizer on the host: no-op streams, the host split": _patch_hybrid_optimizer,
}
MODEL_PATCHES = {
    "moe_utils.te_general_gemm = None without Transformer Engine": _patch_te_general_gemm,
    "group-limited routing ranks a group by its top-2 scores": _patch_group_limited_topk,
    "multi_latent_attention.HAVE_TE = False without Transformer Engine": _patch_mla_without_te,
    "expert-bias load counts skip padding (counted_tokens)": _patch_expert_load_count,
    "torch's norms under sequence parallelism (their weights summed over TP)": _patch_torch_norm_sequence_parallel,
    "optimizer_config.is_te_min_version is False without Transformer Engine": _patch_te_version_without_te,
    "the distributed optimizer's reshardable load keeps torch Adam's step": _patch_reshardable_load_keeps_step,
    "MLA's rope key sums its gradient over TP (local ColumnParallelLinear projections)": _patch_mla_rope_key_gradient,
    "checkpoints may name torch's optimizer classes (HybridDeviceOptimizer's param groups)":
        _allow_hybrid_optimizer_classes_in_checkpoints,
}


def apply_cpu_patches():
    """Apply every patch once (`PATCHES` only when CUDA is absent); return the names applied so far."""
    if _APPLIED:
        return list(_APPLIED)
    patches = dict(MODEL_PATCHES) if torch.cuda.is_available() else {**PATCHES, **MODEL_PATCHES}
    for name, patch in patches.items():
        patch()
        _APPLIED.append(name)
    return list(_APPLIED)


class _LatentCoreAttention:
    """Holds the class built on first use (megatron is imported after the patches)."""

    cls = None


def latent_core_attention():
    """The local core attention for multi-latent attention: megatron's DotProductAttention taking the
    `k_channels`/`v_channels` MLASelfAttention passes (0.16.1's local one does not), its output
    sized by `v_channels` (the value head width, not kv_channels)."""
    if _LatentCoreAttention.cls is not None:
        return _LatentCoreAttention.cls
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class LatentDotProductAttention(DotProductAttention):
        """DotProductAttention whose queries/keys and values have their own head widths (MLA)."""

        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                heads = self.config.num_attention_heads
                self.hidden_size_per_partition = divide(v_channels * heads, self.pg_collection.tp.size())

    _LatentCoreAttention.cls = LatentDotProductAttention
    return LatentDotProductAttention
