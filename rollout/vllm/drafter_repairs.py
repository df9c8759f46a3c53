"""Where vLLM 0.32 runs a kind's drafter otherwise than the draft computes, the repair, per kind
(`DRAFTER_REPAIRS`); each runs inside vLLM's worker process (`collective_rpc`) and changes nothing
where vLLM is right.

- `at_start`, once the engine is built, on the CPU build: its kernels' defects.
- `after_reload`, after every in-place reload of the drafter: what the drafter derives from its
  weights at load time and an in-place reload leaves stale.

DFlash on the CPU build: vLLM's DFlash drafter norms the context keys of all its layers in one call
(`DFlashQwen3Model._normalize_context_k`: `ops.rms_norm` over [layers, tokens, kv_heads, head_dim]
with the layers' k_norm weights stacked as [layers, head_dim]). The CPU build's kernel reads only
the first row of that weight, so every layer's context keys get the FIRST layer's k_norm: a draft
of more than one layer is served, still losslessly, but not as it computes (lower acceptance, and
other drafts than the embedded engine's). `repair_dflash_context_norm` probes the kernel with a
two-row weight and, only where it is wrong, replaces the method with the per-layer norm in torch.
DFlash after a reload: `refresh_dflash_context_projection`.
"""
from dataclasses import dataclass
from typing import Callable, Optional

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


def refresh_dflash_context_projection(model, named):
    """Rebuild what a DFlash drafter derives from its weights once they are reloaded.

    vLLM's DFlash drafter turns context states into every layer's keys and values with one GEMM
    over a copy of the layers' K/V projection rows (`_fused_kv_weight`), a stack of their k-norms
    and aliases of its rotary cache and hidden norm, made at the end of its `load_weights`. In an
    in-place reload that runs before the reload has put every tensor back (the rotary cache is
    still a placeholder), and the CPU build empties the projections once they are repacked, so
    the drafter would fail on its first context. This makes them again once the reload is done,
    the projection copy from the sent tensors `named` in vLLM's layout: per layer, this rank's rows
    of k_proj then v_proj. A quantized drafter (no projection copy) is left as it is."""
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


@dataclass(frozen=True)
class DrafterRepairs:
    """A kind's repairs of vLLM's drafter (see the module docstring)."""

    at_start: Optional[Callable] = None  # (worker) -> bool: swapped; on the CPU build, once
    after_reload: Optional[Callable] = None  # (drafter model, {checkpoint name: tensor sent})


# the kinds whose vLLM drafter needs a repair -> their repairs
DRAFTER_REPAIRS = {"dflash": DrafterRepairs(at_start=repair_dflash_context_norm,
                                            after_reload=refresh_dflash_context_projection)}
NONE = DrafterRepairs()


def repairs_of(method):
    """The repairs of the drafter of speculative `method` (none for most)."""
    return DRAFTER_REPAIRS.get(method, NONE)
